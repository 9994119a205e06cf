"""Label a grid of single-GPU configurations with the twin: the surrogates' training data.

``lora-opt dataset --profile P --grid GRID.yaml --out DIR`` expands the grid (see
``configs/grids/papers.yaml``), splits its points into shards of consecutive point ids, labels each
shard as one Ray task (or serially) and writes it as ``DIR/shard-NNNNN.parquet``.

Crash safety: a shard is written to a temporary file and renamed into place, so a shard file is
either complete or absent; ``DIR/manifest.json`` pins the grid (its hash), the profile and the twin
version.  Rerunning after a kill (even ``kill -9``) skips every complete shard and labels the rest:
no row is computed twice, none is missing.  Every point has its own seed (grid seed + point id),
so serial and Ray runs give identical rows (except ``wall_s``, the measured simulation time).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lora_opt.io import atomic_write_bytes, atomic_write_json
from lora_opt.parallel import run_batches, simulate_dict
from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST, gpu_features
from lora_opt.tracking import profile_hash, tracked_run, twin_version
from twin.errors import ScenarioError
from twin.paths import GRIDS_DIR
from twin.parsing import build_dataclass, check_choice, check_finite, check_type, read_config_file
from twin.flags import PER_INSTANCE_FLAGS, max_lora_rank_for
from twin.profile import VLLM_LORA_RANKS, load_profile
from twin.scenario import DEFAULT_RHO, LENGTH_SOURCES, MAX_DURATION_S, EngineConfig, scenario_dict

METRICS_FLAT = {  # result key -> column(s)
    "ttft_ms": "ttft", "itl_ms": "itl", "tpot_ms": "tpot",
}


@dataclass(frozen=True)
class Grid:
    """A Cartesian grid of single-GPU workloads (the papers' dataset by default)."""

    ranks: tuple[int, ...] = (8, 16, 32)
    """Ranks the adapter groups draw from (combinations with repetition)."""
    rates: tuple[float, ...] = (3.2, 1.6, 0.8, 0.4, 0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125)
    """Per-adapter rates (req/s) the groups draw from (combinations with repetition)."""
    groups: int = 3
    """Adapter groups per workload: the served adapters are split evenly over them."""
    served: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
    """Numbers of adapters served by the GPU."""
    max_loras: tuple[int, ...] = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
    """A_max values; only those <= the served adapters are simulated."""
    duration_s: float = 3600.0
    """Simulated seconds per point."""
    early_stop: bool = True
    """Stop a point as soon as starvation is certain (recorded in ``stopped_early_s``)."""
    rho: float = DEFAULT_RHO
    """Starvation threshold of the labels."""
    seed: int = 0
    """Point ``i`` is simulated with seed ``seed + i``."""
    lengths: str = "sharegpt"
    """Length source of every point (see the scenario's ``lengths.source``)."""
    engine: dict = field(default_factory=lambda: {"max_num_seqs": 2048, "max_num_batched_tokens": 2048})
    """Fixed engine flags of every point (``max_loras``, ``max_lora_rank`` and ``max_cpu_loras``
    come from the point: A_max, the smallest vLLM rank that fits, all adapters in CPU)."""
    shard_size: int = 64
    """Points per shard (one Ray task, one Parquet file)."""
    sample: int | None = None
    """Label only this many points, a seeded uniform sample of the grid (None = every point)."""
    workloads: int | None = None
    """Keep every (served, A_max) point of only this many workloads (rank/rate combinations), a
    seeded sample (None = all) -- the earlier paper's N*/G* model needs each workload's whole
    (served, A_max) surface, which a uniform point sample leaves with ~2 points per workload."""
    load_band: tuple[float, float] | None = None
    """Keep only points whose expected incoming load (served adapters' rates x 416 tokens) lies in
    [lo, hi] tok/s, before sampling -- to put training points where the uniform grid is thin
    (near a GPU's saturation, or at very low load)."""

    def points(self, limit: int | None = None) -> list[dict]:
        """The grid's points in a fixed order (point id = index), or the seeded sample of them;
        ``limit``: only the first ``limit`` (without a filter, expanding only those).  A grid of
        more than :data:`MAX_GRID_POINTS` points must be filtered or limited: it is refused before
        a point is expanded."""
        n = self.size()
        filtered = self.workloads is not None or self.load_band is not None or self.sample is not None
        if not filtered and limit is not None:
            return list(itertools.islice(self._iter_points(), limit))
        if n > MAX_GRID_POINTS:
            raise ScenarioError(f"grid: {n:,} points; at most {MAX_GRID_POINTS:,} are expanded"
                                + ("" if filtered else " (use --limit, or sample:)"))
        out = list(self._iter_points())
        if self.workloads is not None:
            keys = sorted({(tuple(p["ranks"]), tuple(p["rates"])) for p in out})
            keep_keys = set(random.Random(self.seed).sample(keys, min(self.workloads, len(keys))))
            out = [p for p in out if (tuple(p["ranks"]), tuple(p["rates"])) in keep_keys]
        if self.load_band is not None:
            lo, hi = self.load_band
            out = [p for p in out
                   if lo <= DEFAULT_TOKENS_PER_REQUEST * sum(c * q for c, q in zip(split_counts(p["n"], self.groups),
                                                                                     p["rates"])) <= hi]
        if self.sample is not None and self.sample < len(out):
            keep = sorted(random.Random(self.seed).sample(range(len(out)), self.sample))
            out = [out[i] for i in keep]
        return out if limit is None else out[:limit]

    def size(self) -> int:
        """Points of the whole grid (before sampling), counted without expanding it."""
        pairs = sum(1 for n in self.served if n >= self.groups for a in self.max_loras if a <= n)
        return (math.comb(len(self.ranks) + self.groups - 1, self.groups)
                * math.comb(len(self.rates) + self.groups - 1, self.groups) * pairs)

    def _iter_points(self):
        for ranks in itertools.combinations_with_replacement(sorted(self.ranks), self.groups):
            for rates in itertools.combinations_with_replacement(sorted(self.rates, reverse=True), self.groups):
                for n in sorted(self.served):
                    if n < self.groups:
                        continue
                    for a in sorted(self.max_loras):
                        if a <= n:
                            yield {"ranks": list(ranks), "rates": list(rates), "n": n, "max_loras": a}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


#: the most grid points expanded at once (a point is ~0.5 kB in memory); larger grids need a
#: ``--limit`` (expanded lazily) or a ``sample:``/``workloads:``/``load_band:`` filter of a grid this size
MAX_GRID_POINTS = 1_000_000
#: the most adapter groups of a grid point, and the largest served count / A_max
MAX_GRID_GROUPS = 64
MAX_GRID_SERVED = 100_000


def _grid_list(data: dict, key: str, typ: str, where: str, lo: float, hi: float) -> tuple:
    v = data[key]
    if not isinstance(v, list) or not v:
        raise ScenarioError(f"{where}.{key}: expected a non-empty list, got {v!r:.80}")
    if len(v) > 1000:
        raise ScenarioError(f"{where}.{key}: {len(v)} values; at most 1000")
    out = tuple(check_type(x, typ, f"{where}.{key}[{i}]") for i, x in enumerate(v))
    for i, x in enumerate(out):
        check_finite(x, f"{where}.{key}[{i}]", lo, hi)
    return out


def _check_grid_fields(data: dict, where: str) -> dict:
    """The grid file's fields, typed and range-checked (errors name ``where.field``)."""
    if data.get("load_band") is not None:
        lb = data["load_band"]
        if not (isinstance(lb, list) and len(lb) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              for x in lb)
                and all(math.isfinite(x) for x in lb) and 0 <= lb[0] <= lb[1]):
            raise ScenarioError(f"{where}.load_band: expected [lo, hi] tok/s with 0 <= lo <= hi, got {lb!r:.80}")
        data["load_band"] = (float(lb[0]), float(lb[1]))
    limits = {"ranks": ("int", 1, max(VLLM_LORA_RANKS)), "rates": ("float", 1e-9, 1e6),
              "served": ("int", 1, MAX_GRID_SERVED), "max_loras": ("int", 1, MAX_GRID_SERVED)}
    for k, (typ, lo, hi) in limits.items():
        if k in data:
            try:
                data[k] = _grid_list(data, k, typ, where, lo, hi)
            except ScenarioError as exc:
                if k == "rates" and "must be >=" in str(exc):
                    raise ScenarioError(f"{exc} (every rate must be > 0)") from None
                raise
    scalars = {"groups": ("int", 1, MAX_GRID_GROUPS), "duration_s": ("float", 1e-3, MAX_DURATION_S),
               "rho": ("float", 1e-9, 1.0), "seed": ("int", 0, 2**31 - 1), "shard_size": ("int", 1, 1_000_000)}
    for k, (typ, lo, hi) in scalars.items():
        if k in data:
            data[k] = check_type(data[k], typ, f"{where}.{k}")
            check_finite(data[k], f"{where}.{k}", lo, hi)
    for k in ("sample", "workloads"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ScenarioError(f"{where}.{k}: must be an integer >= 1 (or omitted for the whole grid), got {v!r:.80}")
    if "early_stop" in data:
        data["early_stop"] = check_type(data["early_stop"], "bool", f"{where}.early_stop")
    if "lengths" in data:
        check_choice(check_type(data["lengths"], "str", f"{where}.lengths"),
                     [s for s in LENGTH_SOURCES if s not in ("normal", "trace")], f"{where}.lengths")
    if "engine" in data:
        eng = data["engine"]
        if not isinstance(eng, dict):
            raise ScenarioError(f"{where}.engine: expected a mapping of engine flags, got {eng!r:.80}")
        bad = sorted(map(str, set(eng) & set(PER_INSTANCE_FLAGS)))
        if bad:
            raise ScenarioError(f"{where}.engine: {bad} come from each grid point; leave them out")
        flags = build_dataclass(EngineConfig, eng, f"{where}.engine")
        flags.validate(f"{where}.engine")
        data["engine"] = {k: getattr(flags, k) for k in eng}
    return data


def load_grid(path: str | Path) -> tuple[str | None, Grid]:
    """(profile named in the file or None, grid) from a grid YAML; errors name the field."""
    p = Path(path)
    if not p.exists() and (GRIDS_DIR / f"{path}.yaml").exists():
        p = GRIDS_DIR / f"{path}.yaml"
    if not p.exists():
        raise ScenarioError(f"grid file not found: {path} (bundled grids: "
                            f"{sorted(f.stem for f in GRIDS_DIR.glob('*.yaml'))})")
    data = read_config_file(p, "grid") or {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{p}: expected a mapping")
    profile = data.pop("profile", None)
    if profile is not None:
        profile = check_type(profile, "str", f"{p}.profile")
    names = {f.name for f in dataclasses.fields(Grid)}
    unknown = sorted(map(str, set(data) - names))
    if unknown:
        raise ScenarioError(f"{p}: unknown field(s) {unknown}; allowed: {sorted(names | {'profile'})}")
    grid = Grid(**_check_grid_fields(data, str(p)))
    if grid.sample is not None and grid.sample < 1:
        raise ScenarioError(f"{p}.sample: must be >= 1 (or omitted for the whole grid)")
    return profile, grid


def split_counts(n: int, groups: int) -> list[int]:
    return [n // groups + (1 if k < n % groups else 0) for k in range(groups)]


def point_scenario(point: dict, point_id: int, grid: Grid, profile: str) -> dict:
    adapters = [{"count": c, "rank": r, "rate": q}
                for c, r, q in zip(split_counts(point["n"], grid.groups), point["ranks"], point["rates"]) if c > 0]
    max_rank = max_lora_rank_for(point["ranks"])
    return scenario_dict(
        profile, adapters,
        engine={**grid.engine, "max_loras": point["max_loras"], "max_lora_rank": max_rank,
                "max_cpu_loras": max(point["n"], point["max_loras"])},
        arrivals={"process": "poisson"}, lengths={"source": grid.lengths},
        duration_s=grid.duration_s, rho=grid.rho, seed=grid.seed + point_id, early_stop=grid.early_stop)


def _per_adapter(point: dict, groups: int) -> tuple[list[int], list[float]]:
    ranks, rates = [], []
    for c, r, q in zip(split_counts(point["n"], groups), point["ranks"], point["rates"]):
        ranks += [r] * c
        rates += [q] * c
    return ranks, rates


def label_points(items: list[dict]) -> list[dict]:
    """Ray task / serial unit: simulate each point and return its rows."""
    rows = []
    for it in items:
        res = simulate_dict(it["scenario"])
        rows.append(make_row(it, res))
    return rows


def make_row(item: dict, res: dict) -> dict:
    point, grid_groups = item["point"], item["groups"]
    ranks, rates = _per_adapter(point, grid_groups)
    row: dict[str, Any] = {"point_id": item["point_id"], **gpu_features(ranks, rates, point["max_loras"]),
                           "group_ranks": ",".join(map(str, point["ranks"])),
                           "group_rates": ",".join(repr(float(x)) for x in point["rates"])}
    row["status"] = res.get("status")
    row["error"] = res.get("error", "")
    ok = res.get("status") in ("ok", "oom")
    for k in ("throughput_tok_s", "input_throughput", "output_throughput", "running_mean", "waiting_mean"):
        row[k] = float(res[k]) if ok else float("nan")
    row["incoming_token_rate_twin"] = float(res["incoming_token_rate"]) if ok else float("nan")
    row["starving"] = bool(res["starving"]) if ok else True
    for key, col in METRICS_FLAT.items():
        for stat in ("mean", "median", "p99"):
            v = (res.get(key) or {}).get(stat) if ok else None
            row[f"{col}_{stat}_ms"] = float("nan") if v is None else float(v)
    for k in ("completed", "preemptions", "adapter_loads_cpu", "adapter_loads_disk", "kv_cache_tokens"):
        row[k] = int(res[k]) if ok else -1
    row["stopped_early_s"] = float("nan") if not ok or res["stopped_early_s"] is None else float(res["stopped_early_s"])
    row["duration_s"] = float(item["scenario"]["duration_s"])
    row["rho"] = float(item["scenario"]["rho"])
    row["seed"] = int(item["scenario"]["seed"])
    row["profile"] = item["profile_name"]
    row["profile_hash"] = item["profile_hash"]
    row["twin_version"] = item["twin_version"]
    row["wall_s"] = float(res.get("wall_s", float("nan")))
    return row


def shard_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.parquet"


def _shard_complete(path: Path, expected_ids: list[int]) -> bool:
    import pyarrow.parquet as pq  # heavy optional dependency: only when resuming a dataset

    try:
        ids = pq.read_table(path, columns=["point_id"]).column("point_id").to_pylist()
    except Exception:  # noqa: BLE001 - unreadable = incomplete, it will be redone
        return False
    return ids == expected_ids


def _write_shard(path: Path, rows: list[dict]) -> None:
    import pandas as pd  # heavy optional dependency: only when writing shards

    buf = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buf, index=False)
    # atomic, with a temporary name unique to this writer: a shard is complete or absent, and two
    # writers of one directory never share a temporary file (both write identical rows)
    atomic_write_bytes(path, buf.getvalue())


def _remove_stale_temporaries(out: Path) -> None:
    """Temporary shard files of writers that died (``kill -9``) before renaming them."""
    for f in out.glob(".shard-*.tmp"):
        try:
            pid = int(f.name.split(".")[3])
            os.kill(pid, 0)                # still running: its file, leave it
        except ProcessLookupError:
            f.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue


def generate(profile: str | None, grid_path: str | Path, out: str | Path, *, workers: int | None = None,
             ray_address: str | None = None, limit: int | None = None, progress: bool = True,
             tracking_uri: str | None = None, track: bool = True) -> dict:
    """Label the grid into ``out``; resumes where a previous run stopped. Returns a summary."""
    file_profile, grid = load_grid(grid_path)
    profile = profile or file_profile
    if not profile:
        raise ScenarioError("dataset: no profile (give --profile or a 'profile:' field in the grid file)")
    prof = load_profile(profile)
    prof_name, prof_hash = prof.name, profile_hash(prof)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    if limit is not None and limit < 1:
        raise ScenarioError(f"dataset --limit: must be >= 1, got {limit}")
    points = grid.points(limit)
    manifest = {"grid": dataclasses.asdict(grid), "grid_hash": grid.hash(), "profile": prof_name,
                "profile_hash": prof_hash, "twin_version": twin_version(), "n_points": len(points),
                "shard_size": grid.shard_size}
    mpath = out / "manifest.json"
    if mpath.exists():
        old = read_config_file(mpath, "dataset manifest")
        if not isinstance(old, dict):
            raise ScenarioError(f"dataset: {mpath} is not a dataset manifest; use another --out directory")
        for k in ("grid_hash", "profile_hash", "twin_version", "n_points"):
            if old.get(k) != manifest[k]:
                raise ScenarioError(f"dataset: {out} holds a dataset with a different {k} "
                                    f"({old.get(k)} != {manifest[k]}); use another --out directory")
    else:
        atomic_write_json(mpath, manifest, indent=2)
    n_shards = (len(points) + grid.shard_size - 1) // grid.shard_size
    todo, done_points = [], 0
    for i in range(n_shards):
        ids = list(range(i * grid.shard_size, min(len(points), (i + 1) * grid.shard_size)))
        if shard_path(out, i).exists() and _shard_complete(shard_path(out, i), ids):
            done_points += len(ids)
            continue
        items = [{"point": points[j], "point_id": j, "groups": grid.groups, "profile_name": prof_name,
                  "profile_hash": prof_hash, "twin_version": manifest["twin_version"],
                  "scenario": point_scenario(points[j], j, grid, profile)} for j in ids]
        todo.append((i, items))
    t0 = time.perf_counter()
    labelled = 0
    with tqdm(total=len(points), initial=done_points, desc="dataset", unit="row", disable=not progress,
              smoothing=0.05) as bar:
        def on_done(k: int, rows: list[dict]) -> None:
            nonlocal labelled
            _write_shard(shard_path(out, todo[k][0]), rows)
            labelled += len(rows)
            bar.update(len(rows))

        run_batches(label_points, [items for _, items in todo], on_done, workers=workers, ray_address=ray_address,
                    what=f"{sum(len(items) for _, items in todo)} points in {len(todo)} shards",
                    report=lambda msg: bar.set_description_str(f"dataset ({msg})"))
    wall = time.perf_counter() - t0
    summary = {"out": str(out), "rows": len(points), "rows_labelled_now": labelled, "rows_resumed": done_points,
               "shards": n_shards, "wall_s": wall, "rows_per_s": labelled / wall if wall > 0 else float("nan"),
               "dataset_hash": dataset_hash(out), **{k: manifest[k] for k in ("grid_hash", "profile", "twin_version")}}
    # a labelling resumed after a stop is several runs: keep each one's time, so the whole costs add up
    runs = _previous_runs(out / "summary.json")
    runs.append({"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": wall, "rows_labelled": labelled,
                 "workers": workers or "all", "cpus": os.cpu_count()})
    summary["runs"] = runs
    summary["wall_s_all_runs"] = sum(float(r["wall_s"]) for r in runs)
    atomic_write_json(out / "summary.json", summary, indent=2)
    _remove_stale_temporaries(out)
    if track:
        import mlflow  # heavy optional dependency: only when tracking

        with tracked_run("dataset", run_name=f"{prof_name}-{manifest['grid_hash']}", tracking_uri=tracking_uri,
                         profile=prof_name, profile_hash=prof_hash, seeds={"grid_seed_plus_point_id": grid.seed}):
            mlflow.log_params({"profile": prof_name, "grid_hash": manifest["grid_hash"], "points": len(points),
                               "shard_size": grid.shard_size, "duration_s": grid.duration_s,
                               "early_stop": grid.early_stop, "workers": workers or "all",
                               "twin_version": manifest["twin_version"], "dataset_hash": summary["dataset_hash"]})
            mlflow.log_metrics({"rows_labelled": labelled, "wall_s": wall,
                                "rows_per_s": summary["rows_per_s"] if labelled else 0.0})
            mlflow.log_artifact(str(mpath))
    return summary


def _previous_runs(path: Path) -> list[dict]:
    """The runs an existing ``summary.json`` records (one, for a summary written before runs were
    listed); none when there is no readable summary."""
    try:
        old = read_config_file(path, "dataset summary") if path.exists() else None
    except ScenarioError:
        return []
    if not isinstance(old, dict):
        return []
    def numeric(r) -> bool:                 # a hand-edited summary cannot break the sum
        return isinstance(r, dict) and isinstance(r.get("wall_s"), (int, float)) and math.isfinite(r["wall_s"])

    if isinstance(old.get("runs"), list):
        return [r for r in old["runs"] if numeric(r)]
    if numeric(old):
        return [{"wall_s": old["wall_s"], "rows_labelled": old.get("rows_labelled_now")}]
    return []


def dataset_hash(out: str | Path) -> str:
    """sha256 over the rows (wall time excluded), in point order: equal for serial and Ray runs."""
    df = load_dataset(out)
    h = hashlib.sha256()
    h.update(df.drop(columns=["wall_s"]).to_csv(index=False).encode())
    return h.hexdigest()[:16]


def load_dataset(out: str | Path):
    """Every shard of a dataset directory as one DataFrame, sorted by point id."""
    import pandas as pd  # heavy optional dependency: only when reading shards

    files = sorted(Path(out).glob("shard-*.parquet"))
    if not files:
        raise ScenarioError(f"dataset: no shards in {out}")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).sort_values("point_id",
                                                                                          ignore_index=True)
