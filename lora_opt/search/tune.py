"""``lora-opt search --backend tune``: the same study as a Ray Tune experiment.

Same space (``space.suggest`` as Optuna define-by-run), objectives, constraints, greedy seeds and
Optuna storage as the default ask/tell backend (``study.run_search``), so ``lora-opt pareto``'s front
code, ``optuna-dashboard`` and ``study_front`` read a Tune-run study unchanged.  Ray Tune's
``OptunaSearch.on_trial_complete`` tells Optuna only the objective values; ``constrained_searcher``
subclasses it to set the trial's constraints (and metrics, as user attributes) first, so Optuna's
``best_trials`` and constrained TPE see them.

Resumable through Tune's experiment directory (``<out>/tune/<study>``): rerun the same command and
Tune restores the experiment (finished trials kept, unfinished ones run again, the searcher's
Optuna trials restored).  Not reproducible across worker counts: Tune asks the searcher for a trial
whenever a slot frees up, so what TPE has seen depends on timing; the default backend is.
Per-trial overhead: ``lora-opt bench search`` measures both backends side by side.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from lora_opt.parallel import init_ray
from lora_opt.placement.policies import PlacementContext
from lora_opt.search.study import (CONSTRAINTS, SearchOptions, SearchResult, SearchSetup, Traffic, enqueue_seeds,
                                   finished_trials, front_rows, open_storage, open_study, optuna_quiet, run_trial,
                                   suggest)

#: Tune result keys: the two objectives, the constraints, the metrics (flat: Tune flattens nested results)
OBJECTIVE_KEYS = ("objective_gpus", "objective_latency")
CONSTRAINT_KEYS = tuple(f"constraint_{c}" for c in CONSTRAINTS)
METRIC_PREFIX = "metric_"


def tune_trial(config: dict, setup: SearchSetup | None = None, traffic: Traffic | None = None) -> None:
    """The Tune trainable: ``run_trial`` on the configuration Optuna suggested, one report."""
    from ray import tune  # heavy optional dependency: only in the Tune backend

    out = run_trial(config, setup, traffic)
    report = dict(zip(OBJECTIVE_KEYS, out["values"]))
    report.update(zip(CONSTRAINT_KEYS, out["constraints"]))
    report.update({METRIC_PREFIX + k: (float("nan") if v is None else v) for k, v in out["metrics"].items()})
    report["trial_wall_s"] = out["wall_s"]
    tune.report(report)


def record_constraints(ot_trial, result: dict) -> None:
    """Set a finished Tune trial's constraints and metrics on its Optuna trial (before ``tell``)."""
    constraints = [float(result[k]) for k in CONSTRAINT_KEYS]
    for name, v in zip(CONSTRAINTS, constraints):
        ot_trial.set_constraint(name, v)       # Optuna's constraints: feasible iff all <= 0
    ot_trial.set_user_attr("constraints", constraints)
    for k, v in result.items():
        if k.startswith(METRIC_PREFIX):
            ot_trial.set_user_attr(k[len(METRIC_PREFIX):], v)
    ot_trial.set_user_attr("wall_s", result.get("trial_wall_s"))


@functools.cache
def constrained_searcher():
    """``OptunaSearch`` whose ``on_trial_complete`` passes the constraints to Optuna (a class made
    on first use: Ray Tune is an optional dependency)."""
    from ray.tune.search.optuna import OptunaSearch  # heavy optional dependency: only in the Tune backend

    class ConstrainedOptunaSearch(OptunaSearch):
        """OptunaSearch + the trial's constraints set before ``tell`` (Ray's passes values only)."""

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            import optuna  # heavy optional dependency: only in the Tune backend

            ot_trial = self._ot_trials.get(trial_id)
            if (ot_trial is not None and result and trial_id not in self._completed_trials
                    and all(k in result for k in CONSTRAINT_KEYS)):
                try:
                    record_constraints(ot_trial, result)
                except optuna.exceptions.UpdateFinishedTrialError:
                    # resumed: told before the kill, after Tune's last experiment checkpoint
                    self._completed_trials.add(trial_id)
                    return
            super().on_trial_complete(trial_id, result, error)

    return ConstrainedOptunaSearch


def _progress_callback(bar):
    from ray.tune import Callback  # heavy optional dependency: only in the Tune backend

    class Progress(Callback):
        """Advances ``bar`` per finished trial.  Tune pickles its callbacks into the experiment
        directory (for ``Tuner.restore``): the bar is not part of that state."""

        def __init__(self, bar):
            self.bar = bar

        def __getstate__(self):
            return {}

        def __setstate__(self, state):
            self.bar = None

        def on_trial_complete(self, iteration, trials, trial, **info):
            if self.bar is not None:
                self.bar.update(1)

        on_trial_error = on_trial_complete

    return Progress(bar)


def fail_lost(study) -> int:
    """Trials still RUNNING after the experiment: asked by a killed run after Tune's last
    experiment checkpoint, so the restored experiment does not know them; recorded as failed."""
    from optuna.trial import TrialState  # heavy optional dependency: only in the Tune backend

    lost = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in lost:
        study.tell(t.number, state=TrialState.FAIL)
    return len(lost)


def run_tune_search(setup: SearchSetup, ctx: PlacementContext, traffic: Traffic,
                    options: SearchOptions = SearchOptions(), *, tune_dir: Path) -> SearchResult:
    """Run (or resume, from ``tune_dir/<study>``) the study as a Ray Tune experiment until
    ``options.trials`` trials have finished.  No per-trial time limit (Tune has none; the default backend's
    is ``timeout_s``); ``setup.batch`` does not apply (Tune asks whenever a slot frees up)."""
    import optuna  # heavy optional dependency: only when a study runs
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")   # no CSV/JSON/TensorBoard files per trial
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # the experiment state saved at every step, so that a restore after a kill agrees with the
    # Optuna storage (by default Tune saves every 10+ s)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0")
    from ray import tune  # heavy optional dependency: only in the Tune backend

    t0 = time.perf_counter()
    trials, seed, workers = options.trials, options.seed, options.workers
    storage = options.storage or "sqlite:///lora-opt-search.db"
    with optuna_quiet(), tqdm(total=trials, desc="search (tune): greedy seeds", unit="trial",
                              disable=not options.progress) as bar:
        study, study_name = open_study(setup, storage, options.study_name, seed)
        if options.seeds:
            enqueue_seeds(study, setup, ctx)
        done0 = finished_trials(study)
        bar.update(done0)
        bar.set_description_str(f"study {study_name} (tune)")
        init_ray(options.ray_address, workers)
        trainable = tune.with_resources(tune.with_parameters(tune_trial, setup=setup, traffic=traffic), {"cpu": 1})
        exp_dir = Path(tune_dir).resolve() / study_name
        run_config = tune.RunConfig(name=study_name, storage_path=str(exp_dir.parent), verbose=0,
                                    callbacks=[_progress_callback(bar)])
        if tune.Tuner.can_restore(str(exp_dir)):
            tuner = tune.Tuner.restore(str(exp_dir), trainable, resume_unfinished=True, resume_errored=False)
        elif trials - done0 > 0:
            sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=10)
            searcher = constrained_searcher()(
                space=functools.partial(suggest, setup=setup), metric=list(OBJECTIVE_KEYS), mode=["min", "min"],
                sampler=sampler, study_name=study_name, storage=optuna.storages.get_storage(open_storage(storage)))
            tuner = tune.Tuner(trainable, run_config=run_config, tune_config=tune.TuneConfig(
                search_alg=searcher, num_samples=trials - done0, reuse_actors=True,
                max_concurrent_trials=workers or None))
        else:
            tuner = None
        if tuner is not None:
            # the results live in the Optuna storage; Tune's own per-trial result files are off
            # (TUNE_DISABLE_AUTO_CALLBACK_LOGGERS), so its result grid would warn once per trial
            grid_log = logging.getLogger("ray.tune.analysis.experiment_analysis")
            level = grid_log.level
            grid_log.setLevel(logging.ERROR)
            try:
                tuner.fit()
            finally:
                grid_log.setLevel(level)
        lost = fail_lost(study)
        front = front_rows(study, setup.objective)
        all_trials = study.get_trials(deepcopy=False)
    return SearchResult(study_name, storage, len(all_trials), sum(t.state.name == "COMPLETE" for t in all_trials),
                        sum(t.state.name == "FAIL" for t in all_trials), front, time.perf_counter() - t0, lost)
