"""A probe for cross-caller batching of the MiniLM encoder on ONNX Runtime: texts padded at the
end to a bucket length (calibrl.onnx_encoder.BUCKETS) with an attention mask, so that texts of
different lengths can share one forward pass: what calibrl's ONNX encoder does in its ``padded
buckets`` mode, measured here on its graph with every group padded (the encoder itself runs a
group of one length unpadded).

    python benchmarks/probe_padded_encoder.py --texts demo --record benchmarks/records/probe-padded-encoder.json

It asks, per thread count:
- invariance: is a text's vector, padded to its bucket, bitwise the same alone and inside a
  group of 2-16 texts of its bucket at a random position (random companions)?
- agreement: is the padded vector bitwise the text's vector alone and unpadded (the reference
  calibrl serves)? The largest absolute difference is given.
- speed: texts per second when the texts arrive 8 at a time (a server's batch of 8 callers at
  batch 1): each text alone unpadded, one padded forward
  per bucket among the 8, and one forward of all 8 padded to the longest one's bucket. The
  fastest of ``--repeats`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from typing import Any, Sequence

import bench_record  # benchmarks/ is on the path of a script run from it

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
    from calibrl.onnx_encoder import bucket, ensure_exported, load_session, pool

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
    graph = str(ensure_exported(folder))  # calibrl's own graph: input_ids and attention_mask

    def padded(session: Any, rows: Sequence[Sequence[int]]) -> list[Any]:
        width = bucket(max(len(r) for r in rows))
        input_ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        hidden = session.run(None, {"input_ids": input_ids, "attention_mask": mask})[0]
        return [pool(hidden[i, : len(row)], "mean", True) for i, row in enumerate(rows)]

    def plain(session: Any, row: Sequence[int]) -> Any:  # the reference: alone, unpadded
        hidden = session.run(None, {"input_ids": np.array([row], np.int64),
                                    "attention_mask": np.ones((1, len(row)), np.int64)})[0]
        return pool(hidden[0], "mean", True)

    by_bucket: dict[int, list[int]] = {}
    for k, row in enumerate(ids):
        by_bucket.setdefault(bucket(len(row)), []).append(k)
    batches = [ids[i : i + 8] for i in range(0, len(ids) - len(ids) % 8, 8)]
    check_rows, speed_rows = [], []
    for threads in [int(t) for t in args.threads.split(",")]:
        session = load_session(graph, threads, False)
        alone = [padded(session, [row])[0] for row in ids]
        served = [plain(session, row) for row in ids]
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
            differing += int(not np.array_equal(padded(session, [ids[m] for m in members])[position], alone[k]))
        check_rows.append([threads, len(ids), args.groups, differing, f"{agree} of {len(ids)}", f"{largest:.1e}"])

        def each_alone() -> None:
            for batch in batches:
                for row in batch:
                    plain(session, row)

        def per_bucket() -> None:
            for batch in batches:
                groups: dict[int, list] = {}
                for row in batch:
                    groups.setdefault(bucket(len(row)), []).append(row)
                for rows in groups.values():
                    padded(session, rows)

        def all_padded() -> None:
            for batch in batches:
                padded(session, batch)

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
            ["threads", "texts", "groups checked", "rows differing in a group", "padded = alone unpadded, bitwise",
             "largest difference"], check_rows),
        bench_record.table("Texts per second, 8 at a time (ratio to each alone)",
                           ["threads", *fns], speed_rows),
    ]
    bench_record.print_tables(tables)
    if args.record:
        bench_record.write_record(args.record, tables, libraries=("onnxruntime", "torch", "transformers"))


if __name__ == "__main__":
    main()
