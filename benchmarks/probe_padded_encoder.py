"""A probe for cross-caller batching of the MiniLM encoder on ONNX Runtime: texts padded at the
end to a bucket length (16, 24, 32, 48, 64, 96, 128, 256 tokens) with an attention mask, so that
texts of different lengths can share one forward pass: what calibrl's ONNX encoder does in its
``padded buckets`` mode, measured here on a graph the probe exports itself, every group padded.

    python benchmarks/probe_padded_encoder.py --texts demo --record benchmarks/records/probe-padded-encoder.json

It asks, per thread count:
- invariance: is a text's vector, padded to its bucket, bitwise the same alone and inside a
  group of 2-16 texts of its bucket at a random position (random companions)?
- agreement: is the padded vector bitwise the vector calibrl serves today (the text alone,
  unpadded, on the exported graph calibrl caches)? The largest absolute difference is given.
- speed: texts per second when the texts arrive 8 at a time (a server's batch of 8 callers at
  batch 1): each text alone unpadded (today's path when lengths differ), one padded forward
  per bucket among the 8, and one forward of all 8 padded to the longest one's bucket. The
  fastest of ``--repeats`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import tempfile
import time
from typing import Any, Sequence

import bench_record  # benchmarks/ is on the path of a script run from it

BUCKETS = (16, 24, 32, 48, 64, 96, 128, 256)


def bucket(length: int) -> int:
    return next(b for b in BUCKETS if b >= length)


def export_masked(folder: str, target: pathlib.Path) -> pathlib.Path:
    """The encoder with an attention-mask input, exported as calibrl exports its own graph."""
    import warnings

    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()

    class Masked(torch.nn.Module):
        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    sample = (torch.tensor([[101, 2000, 2001, 102], [101, 2002, 102, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    from calibrl.onnx_encoder import OPSET

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Masked(model), sample, str(target), dynamo=False, opset_version=OPSET,
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes={name: {0: "rows", 1: "tokens"}
                                        for name in ("input_ids", "attention_mask", "last_hidden_state")})
    return target


def load_texts(source: str) -> list[str]:
    if source == "demo":
        from calibrl.demo.domain import generate_domain

        domain = generate_domain(0)
        texts = [t.query for split in ("train", "heldout") for t in domain.tasks(split)]
    else:
        texts = [json.loads(line)["question_text"] for line in pathlib.Path(source).read_text().splitlines() if line]
    return [t for t in dict.fromkeys(texts) if t]


def main() -> None:
    import numpy as np

    from calibrl.embedding import resolve_embedder
    from calibrl.onnx_encoder import ensure_exported, load_session, pool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="demo",
                        help="'demo' (the demo domain's queries, seed 0) or a HotpotQA-style JSONL with question_text")
    parser.add_argument("--threads", default="1,2", help="ONNX Runtime intra-op thread counts")
    parser.add_argument("--groups", type=int, default=200, help="random groups of the invariance check")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved speed rounds (the fastest kept)")
    parser.add_argument("--record", metavar="PATH", help="write the tables as a benchmark record")
    args = parser.parse_args()

    _, folder = resolve_embedder(None)
    folder = str(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    texts = load_texts(args.texts)
    ids = tokenizer(texts, truncation=True, max_length=256)["input_ids"]
    lengths = sorted(len(r) for r in ids)
    plain_graph = str(ensure_exported(folder))
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="calibrl-padded-"))
    masked_graph = str(export_masked(folder, workdir / "masked.onnx"))

    def padded(session: Any, rows: Sequence[Sequence[int]]) -> list[Any]:
        width = bucket(max(len(r) for r in rows))
        input_ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        hidden = session.run(None, {"input_ids": input_ids, "attention_mask": mask})[0]
        return [pool(hidden[i, : len(row)], "mean", True) for i, row in enumerate(rows)]

    def plain(session: Any, row: Sequence[int]) -> Any:
        return pool(session.run(None, {"input_ids": np.array([row], np.int64)})[0][0], "mean", True)

    by_bucket: dict[int, list[int]] = {}
    for k, row in enumerate(ids):
        by_bucket.setdefault(bucket(len(row)), []).append(k)
    batches = [ids[i : i + 8] for i in range(0, len(ids) - len(ids) % 8, 8)]
    check_rows, speed_rows = [], []
    for threads in [int(t) for t in args.threads.split(",")]:
        masked = load_session(masked_graph, threads, False)
        today = load_session(plain_graph, threads, False)
        alone = [padded(masked, [row])[0] for row in ids]
        served = [plain(today, row) for row in ids]
        agree = sum(int(np.array_equal(a, b)) for a, b in zip(alone, served))
        largest = max(float(np.abs(a - b).max()) for a, b in zip(alone, served))
        rng = random.Random(threads)
        differing = 0
        for _ in range(args.groups):
            k = rng.randrange(len(ids))
            size = rng.randint(2, 16)
            members = [rng.choice(by_bucket[bucket(len(ids[k]))]) for _ in range(size - 1)]
            position = rng.randrange(size)
            members.insert(position, k)
            differing += int(not np.array_equal(padded(masked, [ids[m] for m in members])[position], alone[k]))
        check_rows.append([threads, len(ids), args.groups, differing, f"{agree} of {len(ids)}", f"{largest:.1e}"])

        def each_alone() -> None:
            for batch in batches:
                for row in batch:
                    plain(today, row)

        def per_bucket() -> None:
            for batch in batches:
                groups: dict[int, list] = {}
                for row in batch:
                    groups.setdefault(bucket(len(row)), []).append(row)
                for rows in groups.values():
                    padded(masked, rows)

        def all_padded() -> None:
            for batch in batches:
                padded(masked, batch)

        fns = {"each alone, unpadded": each_alone, "one padded pass per bucket": per_bucket,
               "one pass, all padded": all_padded}
        best = {name: float("inf") for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                started = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - started)
        texts_done = 8 * len(batches)
        base = texts_done / best["each alone, unpadded"]
        speed_rows.append([threads, *(f"{texts_done / best[n]:.1f} ({texts_done / best[n] / base:.2f}x)" for n in fns)])

    tables = [
        bench_record.table(
            f"Invariance and agreement ({len(ids)} texts from {args.texts}, tokens median {lengths[len(lengths) // 2]}, "
            f"max {lengths[-1]})",
            ["threads", "texts", "groups checked", "rows differing in a group", "padded = served today, bitwise",
             "largest difference"], check_rows),
        bench_record.table("Texts per second, 8 at a time (ratio to each alone)",
                           ["threads", *fns], speed_rows),
    ]
    for item in tables:
        print(f"\n{item['title']}:\n")
        print("| " + " | ".join(item["header"]) + " |")
        print("|" + " --- |" * len(item["header"]))
        for row in item["rows"]:
            print("| " + " | ".join(str(c) for c in row) + " |")
    if args.record:
        bench_record.write_record(args.record, tables, libraries=("onnxruntime", "torch", "transformers"))


if __name__ == "__main__":
    main()
