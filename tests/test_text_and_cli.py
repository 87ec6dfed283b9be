import subprocess
import sys
import time

from calibrl.text import contains_answer, exact_match, normalize_answer, token_f1


def test_answer_normalisation_and_metrics():
    assert normalize_answer("The  Chief of Protocol!") == "chief of protocol"
    assert exact_match("chief of protocol", ["Chief of Protocol"]) == 1.0
    assert exact_match("chief", ["Chief of Protocol"]) == 0.0
    # float64 ratio of small integers: exact to ~1e-16.
    assert abs(token_f1("chief of", ["Chief of Protocol"]) - 0.8) < 1e-9
    assert token_f1("", ["x"]) == 0.0
    assert contains_answer("She served as Chief of Protocol of the US.", ["chief of protocol"])
    assert not contains_answer("Chiefs of Protocolary", ["chief of protocol"])


def test_cli_help_is_instant_and_imports_nothing_heavy():
    code = (
        "import sys, time; t=time.time(); from calibrl.cli import main; main(['--help']); "
        "heavy=[m for m in ('torch','transformers','faiss','grpc','vllm') if m in sys.modules]; "
        "print('HEAVY', heavy); print('SECONDS', time.time()-t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "index build" in out and "serve judge" in out
    assert "HEAVY []" in out


def test_cli_unknown_command_exits_2():
    from calibrl.cli import main

    assert main(["nonsense"]) == 2
