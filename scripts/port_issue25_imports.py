"""Port code written against the layout before issue 25 ("every concept in one room") to the new one.

Run it over files of another branch after merging it (it edits them in place, prints what it fixed):

    python scripts/port_issue25_imports.py $(git ls-files '*.py' '*.md')

It rewrites module paths (``calibrl.judge_server.types`` -> ``calibrl.api.judge``, the judge's
authoring half -> ``calibrl.judge_server.authoring``, ...), names that moved between modules
(``RewriteRollout`` -> ``calibrl.trainer.kinds.rewrite``, ...) and ``model.score_rewrites(x)`` /
``model.score_search(x)`` calls (now functions of the kinds: ``score_rewrites(model, x)``).
Names moved by hand, not by this script: ``JudgeConfig`` (``calibrl.api.judge_config``, still
re-exported by ``calibrl.judge_server.config``), the validation records
(``calibrl.judge_server.validation_records``, re-exported by ``authoring.validation``), and
``batch.old_logp`` (now ``PendingBatch.behaviour_logp``). A one-off tool: delete it once no
branch from before the change is left.
"""
import re, sys, pathlib
subs = [
    (r"calibrl\.judge_server\.types\b", "calibrl.api.judge"),
    (r"calibrl\.retrieval_server\.types\b", "calibrl.api.retrieval"),
    (r"calibrl\.judge_server\.wire\b", "calibrl.api.judge_wire"),
    (r"calibrl\.retrieval_server\.wire\b", "calibrl.api.retrieval_wire"),
    (r"calibrl\.judge_server\.entities\b", "calibrl.entities"),
    (r"calibrl\.judge_server\.(feedback|distill|train_judge|validation)\b", r"calibrl.judge_server.authoring.\1"),
    (r"\bjudge_server/types\.py", "calibrl/api/judge.py"),
    (r"\bretrieval_server/types\.py", "calibrl/api/retrieval.py"),
    (r"\bjudge_server/wire\.py", "calibrl/api/judge_wire.py"),
    (r"\bretrieval_server/wire\.py", "calibrl/api/retrieval_wire.py"),
    (r"\bjudge_server/entities\.py", "calibrl/entities.py"),
    (r"\bjudge_server/(feedback|distill|train_judge|validation)\.py", r"judge_server/authoring/\1.py"),
]
def fix_from_import(m):
    # from calibrl.X_server import a, wire as w, b
    pkg, names = m.group(1), m.group(2)
    movers = {"judge_server": {"types": ("calibrl.api", "judge"), "wire": ("calibrl.api", "judge_wire"),
                               "entities": ("calibrl", "entities"),
                               **{n: ("calibrl.judge_server.authoring", n) for n in ("feedback", "distill", "train_judge", "validation")}},
              "retrieval_server": {"types": ("calibrl.api", "retrieval"), "wire": ("calibrl.api", "retrieval_wire")}}[pkg]
    parts = [p.strip() for p in names.split(",")]
    keep, lines = [], []
    for p in parts:
        name, _, alias = p.partition(" as ")
        if name in movers:
            base, new = movers[name]
            alias = alias or name
            lines.append(f"from {base} import {new}" + (f" as {alias}" if alias != new else ""))
        else:
            keep.append(p)
    indent = m.group(0)[: len(m.group(0)) - len(m.group(0).lstrip())]
    out = []
    if keep:
        out.append(f"{indent}from calibrl.{pkg} import {', '.join(keep)}")
    out += [indent + l for l in lines]
    return "\n".join(out)
pat = re.compile(r"^[ \t]*from calibrl\.(judge_server|retrieval_server) import ([\w ,]+)$", re.M)

R, S = "calibrl.trainer.kinds.rewrite", "calibrl.trainer.kinds.search"
MOVES = {
    ("calibrl.trainer.rewards", "RewriteRollout"): (R, "RewriteRollout"),
    ("calibrl.trainer.rewards", "SearchRollout"): (S + ".records", "SearchRollout"),
    ("calibrl.trainer.rewards", "SearchStepRecord"): (S + ".records", "SearchStepRecord"),
    ("calibrl.trainer.rollout", "rollout_rewrites"): (R, "rollout_rewrites"),
    ("calibrl.trainer.rollout", "parse_rewrite"): (R, "parse_rewrite"),
    ("calibrl.trainer.rollout", "rollout_search"): (S + ".rollout", "rollout_search"),
    ("calibrl.trainer.rollout", "search_prompt"): (S + ".rollout", "search_prompt_ids"),
    ("calibrl.trainer.rollout", "observation_tokens"): (S + ".rollout", "observation_tokens"),
    ("calibrl.trainer.rollout", "_check_common"): ("calibrl.trainer.rollout", "check_rollout_args"),
    ("calibrl.trainer.rollout", "_checked_completions"): ("calibrl.trainer.rollout", "checked_completions"),
    ("calibrl.trainer.rollout", "_group_index"): ("calibrl.trainer.rollout", "group_index"),
    ("calibrl.trainer.eval", "evaluate_rewrites"): (R, "evaluate_rewrites"),
    ("calibrl.trainer.eval", "raw_query_metrics"): (R, "raw_query_metrics"),
    ("calibrl.trainer.eval", "query_scores"): (R, "query_scores"),
    ("calibrl.trainer.eval", "evaluate_search"): (S + ".metrics", "evaluate_search"),
    ("calibrl.sme.eval_items", "rewrite_items"): (R, "rewrite_items"),
    ("calibrl.sme.eval_items", "search_items"): (S + ".metrics", "search_items"),
    ("calibrl.trainer.diagnostics", "search_metrics"): (S + ".metrics", "collapse_metrics"),
    ("calibrl.trainer.builtin_kinds", "REWRITE"): (R, "REWRITE"),
    ("calibrl.trainer.builtin_kinds", "SEARCH"): (S, "SEARCH"),
    ("calibrl.trainer.step_rewards", "step_metrics"): (S + ".step_rewards", "step_reward_metrics"),
    ("calibrl.trainer.step_log", "step_metrics"): ("calibrl.trainer.step_log", "rank_step_metrics"),
}
MODULE_MOVES = {"calibrl.trainer.step_rewards": S + ".step_rewards"}
IMP = re.compile(r"^(?P<ind>[ \t]*)from (?P<mod>calibrl\.[\w.]+) import (?P<names>\((?:[^)]*)\)|[^\n]+)", re.M)
def names_of(s):
    s = s.strip()
    comment = ""
    if s.startswith("("):
        s = s[1:s.rindex(")")]
        s = "\n".join(l.split("#")[0] for l in s.splitlines())
    else:
        if "#" in s: s, comment = s.split("#", 1); comment = "  #" + comment
    return [n.strip() for n in s.replace("\n", " ").split(",") if n.strip()], comment
def render(ind, mod, names, comment=""):
    line = f"{ind}from {mod} import {', '.join(names)}{comment}"
    if len(line) <= 120: return line
    body = "".join(f"{ind}    {n},\n" for n in names)
    return f"{ind}from {mod} import ({comment.strip() and ' ' + comment.strip()}\n{body}{ind})"
def fix(text):
    renames = {}
    def sub(m):
        ind, mod = m.group("ind"), m.group("mod")
        mod2 = MODULE_MOVES.get(mod, mod)
        names, comment = names_of(m.group("names"))
        groups = {}
        for n in names:
            base, _, alias = n.partition(" as ")
            base = base.strip(); alias = alias.strip()
            tgt = MOVES.get((mod, base)) or MOVES.get((mod2, base))
            if tgt:
                newmod, newname = tgt
                if newname != base and not alias: renames[base] = newname
                groups.setdefault(newmod, []).append(newname + (f" as {alias}" if alias else ""))
            else:
                groups.setdefault(mod2, []).append(n)
        if list(groups) == [mod] and groups[mod] == names: return m.group(0)
        return "\n".join(render(ind, k, v, comment if i == 0 else "") for i, (k, v) in enumerate(groups.items()))
    text = IMP.sub(sub, text)
    for old, new in renames.items():
        text = re.sub(rf"(?<![\w.]){old}\b(?!\s*=)", new, text) if old != "search_prompt" else re.sub(r"(?<![\w.])search_prompt\(", "search_prompt_ids(", text)
    for old, new in MODULE_MOVES.items():
        text = text.replace(old, new)
    return text
def receiver_calls(text, meth, func, module):
    out, i, changed = [], 0, False
    key = "." + meth + "("
    while True:
        j = text.find(key, i)
        if j < 0: out.append(text[i:]); break
        # walk back over the receiver expression
        k = j; depth = 0
        while k > 0:
            c = text[k-1]
            if c == ")": depth += 1
            elif c == "(":
                if depth == 0: break
                depth -= 1
            elif depth == 0 and not (c.isalnum() or c in "_."): break
            k -= 1
        recv = text[k:j]
        if not recv or recv == "self":
            out.append(text[i:j+len(key)]); i = j + len(key); continue
        out.append(text[i:k] + f"{func}({recv}, "); i = j + len(key); changed = True
    res = "".join(out)
    res = res.replace(f"{func}({recv}, )", f"{func}({recv})") if changed else res
    return res, changed
def main(paths: list[str]) -> None:
    for f in paths:
        p = pathlib.Path(f)
        t = p.read_text()
        o = t
        t = pat.sub(fix_from_import, t)
        for a, b in subs:
            t = re.sub(a, b, t)
        t = fix(t)
        for meth, mod in (("score_rewrites", "calibrl.trainer.kinds.rewrite"),
                          ("score_search", "calibrl.trainer.kinds.search.reward")):
            t, changed = receiver_calls(t, meth, meth, mod)
            if changed and f"import {meth}" not in t and f" {meth}," not in t:
                print(f"{f}: add 'from {mod} import {meth}'")
        if t != o:
            p.write_text(t)
            print("fixed", f)


if __name__ == "__main__":
    main(sys.argv[1:])
