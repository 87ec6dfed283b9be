"""A server process moves what it loaded out of the garbage collector's reach once it serves
(`calibrl.serving.freeze_loaded_objects`): a full collection then scans only what calls allocate."""

from __future__ import annotations

import inspect
import subprocess
import sys


def test_freezing_moves_the_loaded_objects_out_of_the_collectors_reach():
    code = ("import gc; from calibrl.serving import freeze_loaded_objects; before = gc.get_freeze_count(); "
            "freeze_loaded_objects(); print(before, gc.get_freeze_count(), gc.get_count()[2])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, frozen, oldest = map(int, done.stdout.split())
    assert before == 0 and frozen > 1000  # every object the imports made
    assert oldest == 0  # nothing left for a full collection to scan


def test_both_server_processes_freeze_once_serving_and_in_process_servers_do_not():
    from calibrl.judge_server import cli as judge_cli
    from calibrl.retrieval_server import server as retrieval_server
    from calibrl import serving

    for source in (inspect.getsource(judge_cli.serve), inspect.getsource(retrieval_server.serve)):
        assert source.index("await start(config)") < source.index("freeze_loaded_objects()")
    # start_server is what tests and embedding applications call: it never freezes their objects
    assert "freeze" not in inspect.getsource(serving.start_server)
