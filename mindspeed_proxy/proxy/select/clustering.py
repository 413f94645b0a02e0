"""Exactly-K clustering of a layer's experts from their similarity matrix, and the representative rule."""
from __future__ import annotations

from typing import Optional

import numpy as np

from mindspeed_proxy.extras import require
from mindspeed_proxy.proxy.core.errors import ConversionError


def angular_distance(similarity: np.ndarray) -> np.ndarray:
    """arccos(cosine) / pi in [0, 1], zero diagonal."""
    dist = np.arccos(np.clip(similarity, -1.0, 1.0)) / np.pi
    dist = (dist + dist.T) / 2
    np.fill_diagonal(dist, 0.0)
    return dist


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters 0..K-1 in order of their smallest member."""
    order = {}
    for lab in labels:
        order.setdefault(int(lab), len(order))
    return np.array([order[int(lab)] for lab in labels])


def agglomerative(dist: np.ndarray, k: int) -> np.ndarray:
    """Average-linkage clustering cut at exactly `k` clusters (deterministic)."""
    require("scipy", "clustering (--cluster agglomerative)", extra="proxy")
    from scipy.cluster.hierarchy import cut_tree, linkage
    from scipy.spatial.distance import squareform

    n = dist.shape[0]
    if k == n:
        return np.arange(n)
    if k == 1:
        return np.zeros(n, dtype=int)
    tree = linkage(squareform(dist, checks=False), method="average")
    return _canonical(cut_tree(tree, n_clusters=k).reshape(-1))


def embedding(similarity: np.ndarray) -> np.ndarray:
    """Points whose Gram matrix is the (PSD part of the) similarity matrix: one row per expert."""
    values, vectors = np.linalg.eigh(similarity)
    return vectors * np.sqrt(np.clip(values, 0.0, None))


def usage_weights(usage) -> np.ndarray:
    """k-means sample weights from usage counts: the usage share, floored at 1e-6 so unused experts still count."""
    counts = np.asarray(usage, dtype=np.float64)
    return counts / max(counts.sum(), 1e-300) + 1e-6


def kmeans(similarity: np.ndarray, k: int, seed: int, weights: Optional[np.ndarray] = None) -> np.ndarray:
    """k-means with `k` clusters on an exact embedding of the similarity (Gram) matrix, seeded.

    With `weights` (usage-weighted clustering) each expert counts in proportion to its weight: the
    objective is the usage-weighted sum of squared distances to the cluster centres."""
    KMeans = require("sklearn.cluster", "clustering (--cluster kmeans)").KMeans

    points = embedding(similarity)
    labels = KMeans(n_clusters=k, random_state=seed, n_init=10).fit(points, sample_weight=weights).labels_
    if len(set(labels.tolist())) != k:
        raise ConversionError(f"k-means found {len(set(labels.tolist()))} distinct clusters, not {k} "
                              "(duplicate experts?); use --cluster agglomerative")
    return _canonical(labels)


TIE = 1e-12  # medoid scores closer than this are a tie (a two-member cluster's always are: d + 0 = 0 + d)


def representatives(labels: np.ndarray, dist: np.ndarray, rule: str, usage: Optional[np.ndarray] = None,
                    saliency: Optional[np.ndarray] = None, router_norms: Optional[np.ndarray] = None) -> list[int]:
    """One member per cluster: the medoid (least total distance), the most-used member (rules usage and
    merge: merge keeps the most-used member's slot) or the most salient member. Medoid ties (every two-member
    cluster) go to the most-used member when usage counts are known, then to the larger router row norm
    (`router_norms`), then to the lower id; other ties -> lower id."""
    reps = []
    for cluster in range(int(labels.max()) + 1):
        members = np.flatnonzero(labels == cluster)
        if rule in ("usage", "merge"):
            if usage is None:
                raise ConversionError(f"--representative {rule} needs expert usage counts (--usage-file FILE)")
            score = -np.asarray(usage, dtype=np.float64)[members]
        elif rule == "saliency":
            if saliency is None:
                raise ConversionError("--representative saliency needs --calibration-data PATH")
            score = -np.asarray(saliency, dtype=np.float64)[members]
        else:
            score = dist[np.ix_(members, members)].sum(axis=1)
            tied = members[score <= score.min() + TIE]
            reps.append(_break_tie(tied, usage, router_norms))
            continue
        reps.append(int(members[np.argmin(score)]))  # argmin returns the first (lowest id) of ties
    return reps


def _break_tie(tied: np.ndarray, usage, router_norms) -> int:
    """The most-used of the tied members, then the one with the larger router row norm, then the lowest id."""
    keys = [tied]
    for values in (router_norms, usage):  # np.lexsort sorts by the last key first
        if values is not None:
            keys.append(-np.asarray(values, dtype=np.float64)[tied])
    return int(tied[np.lexsort(keys)[0]])


def cluster_layer(similarity: np.ndarray, k: int, method: str = "agglomerative", seed: int = 0,
                  num_groups: Optional[int] = None, representative: str = "medoid",
                  usage: Optional[np.ndarray] = None, saliency: Optional[np.ndarray] = None,
                  usage_weighted: bool = False, router_norms: Optional[np.ndarray] = None) -> dict:
    """Labels (per expert), kept ids (sorted) and distance summary for one layer.

    With group-limited routing (`num_groups`) each contiguous group of E/groups experts is clustered
    into K/groups on its own, so every group keeps the same number of experts. `usage_weighted`:
    k-means with the experts' usage shares as sample weights (needs `usage`). `router_norms`: the L2 norm of
    each expert's router row, which breaks medoid ties after usage (`representatives`)."""
    if usage_weighted and usage is None:
        raise ConversionError("--usage-weighted needs expert usage counts (--usage-file FILE or --calibration-data)")
    n = similarity.shape[0]
    groups = num_groups or 1
    dist = angular_distance(similarity)
    labels = np.empty(n, dtype=int)
    offset = 0
    size, per = n // groups, k // groups
    for g in range(groups):
        idx = np.arange(g * size, (g + 1) * size)
        sub_sim, sub_dist = similarity[np.ix_(idx, idx)], dist[np.ix_(idx, idx)]
        if method == "agglomerative":
            sub = agglomerative(sub_dist, per)
        else:
            weights = usage_weights(np.asarray(usage, dtype=np.float64)[idx]) if usage_weighted else None
            sub = kmeans(sub_sim, per, seed + g, weights)
        labels[idx] = sub + offset
        offset += per
    kept = sorted(representatives(labels, dist, representative, usage, saliency, router_norms))
    return {"labels": labels.tolist(), "kept": kept, "sizes": np.bincount(labels, minlength=k).tolist(),
            "distances": _summary(labels, dist, kept)}


def merge_weights(labels, kept: list, usage) -> list:
    """For each kept id (in `kept` order): [[member, weight], ...] of its cluster, weights = usage shares
    within the cluster (equal weights if the cluster was never used)."""
    labels = np.asarray(labels)
    counts = np.asarray(usage, dtype=np.float64)
    out = []
    for rep in kept:
        members = np.flatnonzero(labels == labels[rep])
        w = counts[members]
        w = w / w.sum() if w.sum() > 0 else np.full(len(members), 1.0 / len(members))
        out.append([[int(m), float(x)] for m, x in zip(members, w)])
    return out


def random_selection(similarity: np.ndarray, k: int, seed, num_groups: Optional[int] = None) -> dict:
    """Baseline: K/groups experts drawn at random in each group; others labelled by nearest kept.

    `seed` is an int or a tuple such as (seed, layer): numpy's SeedSequence mixes the parts, so
    consecutive seeds do not reuse each other's draws shifted by one layer."""
    n = similarity.shape[0]
    groups = num_groups or 1
    size, per = n // groups, k // groups
    rng = np.random.default_rng(seed)
    kept = sorted(int(g * size + i) for g in range(groups) for i in rng.choice(size, per, replace=False))
    return _assign_to_kept(similarity, kept, groups)


def usage_selection(similarity: np.ndarray, k: int, usage, num_groups: Optional[int] = None) -> dict:
    """Baseline: the K/groups most-used experts of each group (ties -> lower id); others labelled by nearest kept."""
    n = similarity.shape[0]
    groups = num_groups or 1
    size, per = n // groups, k // groups
    counts = np.asarray(usage, dtype=np.float64)
    kept = []
    for g in range(groups):
        idx = np.arange(g * size, (g + 1) * size)
        order = np.lexsort((idx, -counts[idx]))  # most used first, then lower id
        kept += [int(idx[i]) for i in order[:per]]
    return _assign_to_kept(similarity, sorted(kept), groups)


def _assign_to_kept(similarity: np.ndarray, kept: list, groups: int) -> dict:
    n = similarity.shape[0]
    dist = angular_distance(similarity)
    size = n // groups
    labels = np.empty(n, dtype=int)
    for i in range(n):
        own = [c for c, g in enumerate(kept) if g // size == i // size]
        labels[i] = own[int(np.argmin(dist[i, [kept[c] for c in own]]))] if i not in kept else kept.index(i)
    return {"labels": labels.tolist(), "kept": list(kept), "sizes": np.bincount(labels, minlength=len(kept)).tolist(),
            "distances": _summary(labels, dist, kept)}


def without(similarity: np.ndarray, k: int, excluded: set, num_groups: Optional[int], run) -> dict:
    """A selection that never picks an expert of `excluded`: `run(idx, per)` selects `per` experts among the
    others (indices `idx`) of each routing group; excluded experts get label -1 and belong to no cluster."""
    n = similarity.shape[0]
    groups = num_groups or 1
    size, per = n // groups, k // groups
    labels, kept, offset = np.full(n, -1), [], 0
    for g in range(groups):
        idx = np.array([i for i in range(g * size, (g + 1) * size) if i not in excluded])
        if len(idx) < per:
            where = f" in routing group {g}" if groups > 1 else ""
            raise ConversionError(f"--non-finite-experts exclude: only {len(idx)} finite experts{where}, fewer than "
                                  f"the {per} to keep there")
        result = run(idx, per)
        labels[idx] = np.asarray(result["labels"]) + offset
        kept += [int(idx[i]) for i in result["kept"]]
        offset += per
    kept = sorted(kept)
    finite = np.flatnonzero(labels >= 0)
    dist = angular_distance(similarity[np.ix_(finite, finite)])
    summary = _summary(labels[finite], dist, [int(np.flatnonzero(finite == g)[0]) for g in kept])
    return {"labels": labels.tolist(), "kept": kept, "sizes": np.bincount(labels[finite], minlength=k).tolist(),
            "distances": summary, "excluded": sorted(int(g) for g in excluded)}


def _summary(labels: np.ndarray, dist: np.ndarray, kept: list) -> dict:
    same = labels[:, None] == labels[None, :]
    off = ~np.eye(len(labels), dtype=bool)
    intra, inter = dist[same & off], dist[~same]
    to_rep = [float(dist[i, kept[int(np.flatnonzero(labels[kept] == labels[i])[0])]]) for i in range(len(labels))]
    return {"mean_intra": float(intra.mean()) if intra.size else 0.0,
            "max_intra": float(intra.max()) if intra.size else 0.0,
            "mean_inter": float(inter.mean()) if inter.size else 0.0,
            "max_to_representative": max(to_rep)}
