"""Which searched parameter mattered: Optuna's fANOVA importance over the search's finished trials.

fANOVA (Hutter et al., 2014) fits a random forest from the parameters to the objective and splits
the forest's variance into a share per parameter; `optuna.importance.get_param_importances`
normalises the shares to sum to 1, so "lr 71%" reads: of the variation in val_acc that the
parameters explain one at a time, 71% comes from the learning rate. The evaluator is seeded, so
the same trials give the same shares. Optuna's fANOVA uses scikit-learn's forest (installed with
MLflow). Optuna 5's default evaluator (PED-ANOVA) is not used: it ranks what separates the top
10% of trials, which a search of tens of trials holds one or two of.

Only with MIN_TRIALS finished trials or more: a forest fitted to fewer points follows single
trials, and one trial more or less can swap the order of the parameters. Below it, and when
every trial reached the same value, `Importance.shares` is empty and `reason` says why.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.outputs.plot_drawing import PLOT_DPI
from vidtune.tune.outputs.results import TrialResult, objective_key
from vidtune.tune.outputs.status import WITH_RESULT

MIN_TRIALS = 8
SEED = 0                       # the forest's: the same trials give the same shares
METRIC_PREFIX = "importance_"   # MLflow: importance_lr, importance_batch_size, ...

Trial = tuple[dict[str, Any], float]   # (params, objective value)


@dataclass(frozen=True)
class Importance:
    """Share of the explained variation per parameter (sums to 1, largest first; empty when not
    computed, with `reason`), over `trials` finished trials, of the objective `metric`."""

    metric: str
    trials: int
    shares: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def sentence(self) -> str:
        """For the summary: "lr explains 71% of the variation in val_acc, batch_size 29% (fANOVA
        over 12 finished trials)", or why there is none."""
        if not self.shares:
            return f"parameter importance: not computed ({self.reason})"
        (first, share), *rest = self.shares.items()
        others = "".join(f", {name} {s:.0%}" for name, s in rest)
        return (f"{first} explains {share:.0%} of the variation in {self.metric}{others} "
                f"(fANOVA over {self.trials} finished trials)")

    def metrics(self) -> dict[str, float]:
        """For the MLflow parent run: importance_<param> -> share in [0, 1]; empty without shares."""
        return {f"{METRIC_PREFIX}{name}": share for name, share in self.shares.items()}

    def plot(self, path: Path, *, title: str = "") -> Path | None:
        """A bar per parameter (its share, in %), largest on top; PNG at tune.outputs.plots' DPI. None
        (nothing written) without shares."""
        if not self.shares:
            return None
        names = list(self.shares)[::-1]
        fig = Figure(figsize=(5.5, 0.6 * len(names) + 1.3))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        bars = ax.barh(names, [100 * self.shares[n] for n in names], color="#1f77b4")
        ax.bar_label(bars, fmt="%.0f%%", padding=3)
        ax.set_xlim(0, 112)
        ax.set_xlabel(f"share of the variation in {self.metric} (%)")
        ax.set_title(f"{title + ': ' if title else ''}parameter importance (fANOVA, {self.trials} trials)",
                     fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=PLOT_DPI, facecolor="white")
        return path


def finished_trials(rows: Iterable[TrialResult], objective: str = Key.VAL_ACC) -> list[Trial]:
    """(params, value) of the DONE and STOPPED rows with a finite value of `objective` (pareto:
    val_acc); the params are the searched values a row has (`tune.config.searched.PARAMS`)."""
    key = objective_key(objective)
    out = []
    for r in rows:
        value = getattr(r, key)
        if r.status in WITH_RESULT and math.isfinite(value):
            params = {p.name: r.value(p.name) for p in searched.PARAMS if r.value(p.name) is not None}
            out.append((params, value))
    return out


def param_importances(trials: Iterable[TrialResult | Trial], *, objective: str = Key.VAL_ACC,
                      space: Any = None) -> Importance:
    """fANOVA importance of each searched parameter (see the module docstring) from TrialRows
    (their finished ones) or (params, value) pairs. `space`: the search space
    (`tune.config.options.SearchSpace`), whose bounds and choices the distributions take (default: the
    values the trials span)."""
    trials = list(trials)
    rows = [t for t in trials if isinstance(t, TrialResult)]
    pairs = finished_trials(rows, objective) + [t for t in trials if not isinstance(t, TrialResult)]
    metric = objective_key(objective)
    if len(pairs) < MIN_TRIALS:
        return Importance(metric, len(pairs), reason=f"{len(pairs)} finished trial(s); it needs at least "
                          f"{MIN_TRIALS}, below which one trial more or less can reorder the parameters")
    if len({value for _, value in pairs}) == 1:
        return Importance(metric, len(pairs), reason=f"every finished trial reached the same {metric}")
    distributions = _distributions([params for params, _ in pairs], space)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # not "A new study created in memory"
    try:
        study = optuna.create_study(direction="maximize")
    finally:
        optuna.logging.set_verbosity(verbosity)
    study.add_trials([optuna.trial.create_trial(params={name: params[name] for name in distributions},
                                                distributions=distributions, value=value)
                      for params, value in pairs])
    shares = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=SEED))
    return Importance(metric, len(pairs), shares={name: float(s) for name, s in shares.items()})


def _distributions(points: Sequence[dict[str, Any]], space: Any
                   ) -> dict[str, optuna.distributions.BaseDistribution]:
    """Optuna's distribution per declared parameter the points hold, as Ray's OptunaSearch converts
    tune/study/space.py's space: a choice categorical, a range a float range (log for a log scale),
    widened to the values seen."""
    domains = searched.domains(space) if space is not None else {}
    dists: dict[str, optuna.distributions.BaseDistribution] = {}
    for name in points[0]:
        p, d = searched.by_name(name), domains.get(name)
        if p is None:
            continue
        seen = [point[name] for point in points]
        if p.is_choice:
            dists[name] = optuna.distributions.CategoricalDistribution(
                sorted(set(seen) | set(d.choices if d else ())))
        else:
            lo, hi = (d.low, d.high) if d else (min(seen), max(seen))
            dists[name] = optuna.distributions.FloatDistribution(min(lo, min(seen)), max(hi, max(seen)),
                                                                 log=p.scale == "log")
    return dists
