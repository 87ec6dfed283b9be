"""The `calibrl` command line.

One program, subcommands routed by name to the module that owns them. Routing
imports nothing heavy, so `calibrl --help` answers at once; each subcommand
parses its own arguments (`calibrl index build --help`).
"""

from __future__ import annotations

import importlib
import sys

# (words of the command) -> ("module:function", one-line help). The function takes
# the remaining argv and returns an exit code.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("index", "build"): ("calibrl.retrieval_server.cli:index_build", "Build a fixed retrieval index from a corpus."),
    ("index", "info"): ("calibrl.retrieval_server.cli:index_info", "Print an index folder's manifest and check its files."),
    ("serve", "retrieval"): ("calibrl.retrieval_server.cli:serve", "Serve an index over gRPC (RetrievalService)."),
    ("serve", "judge"): ("calibrl.judge_server.cli:serve", "Serve rubric judges over gRPC (JudgeService)."),
    ("rubric", "distill"): ("calibrl.judge_server.cli:distill", "Distil SME feedback (JSONL) into a rubric and a golden set."),
    ("rubric", "validate"): ("calibrl.judge_server.cli:validate", "Check a rubric + judge against the SME golden set."),
    ("rubric", "reload"): ("calibrl.judge_server.admin_cli:reload", "Ask a judge server to reread its rubric folder now (ReloadRubrics)."),
    ("rubric", "train-judge"): ("calibrl.judge_server.cli:train_judge", "Fine-tune a causal LM judge on SME feedback."),
    ("train",): ("calibrl.trainer.cli:train", "Run GRPO / CalibAdv training against the two services."),
    ("eval",): ("calibrl.trainer.cli:evaluate", "Evaluate a policy (or its base) on held-out tasks."),
    ("sme", "sample"): ("calibrl.sme.cli:sample", "Choose the few items worth an expert's review."),
    ("sme", "review"): ("calibrl.sme.cli:review", "Serve a local page where experts grade a sample."),
    ("sme", "drift"): ("calibrl.sme.cli:drift", "Does the judge still agree with freshly graded items? (alarm)"),
    ("demo", "living-rubric"): ("calibrl.demo.living_rubric:main", "Opt-in demo: a gamed rubric caught by fresh expert grades, fixed mid-run."),
    ("demo",): ("calibrl.demo.cli:main", "Run the whole loop on the built-in domain (no downloads)."),
    ("study",): ("calibrl.studies.search_arms:main", "Train the search agent's arms over seeds; intervals and paired tests."),
    ("health",): ("calibrl.healthcheck:main", "Ask a server over the gRPC health protocol whether it serves."),
}


def _usage() -> str:
    from calibrl import __version__

    lines = [
        f"calibrl {__version__}: SME-calibrated rewards and calibrated GRPO for retrieval agents.",
        "",
        "usage: calibrl <command> [options]   (calibrl <command> --help for its options)",
        "",
        "commands:",
    ]
    width = max(len(" ".join(words)) for words in COMMANDS)
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<{width}}  {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from calibrl import __version__

        print(__version__)
        return 0
    for length in (2, 1):
        words = tuple(argv[:length])
        if words in COMMANDS:
            target, _ = COMMANDS[words]
            module_name, func_name = target.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            return int(func(argv[length:]) or 0)
    groups = sorted({words[0] for words in COMMANDS if len(words) > 1})
    if argv[0] in groups:
        subs = [w[1] for w in COMMANDS if w[0] == argv[0] and len(w) > 1]
        print(f"calibrl {argv[0]}: choose one of {subs}", file=sys.stderr)
    else:
        print(f"calibrl: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
