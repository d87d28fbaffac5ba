"""Adaptive layout-strategy tuning (AL-Ansor) on MetaSchedule.

Entry points: ``tune_tir``, ``tune_relax``, ``adaptive_layout_tuning_pass``. Attributes are
loaded lazily so that builder worker processes, which import ``build_fn`` from this package,
do not pay for importing the tuning code.
"""
import importlib

_EXPORTS = {
    "tune_tir": "entry_points",
    "tune_relax": "entry_points",
    "adaptive_layout_tuning_pass": "entry_points",
    "default_builder": "entry_points",
    "tune_task": "task_loop",
    "TaskTuningResult": "task_loop",
    "Strategy": "strategies",
    "derive_programs": "strategies",
    "strategy_of": "strategies",
    "PredefinedRule": "selectors",
    "BanditSelector": "selectors",
    "LeaderRule": "selectors",
    "StallRule": "selectors",
    "FixedStrategy": "selectors",
    "RoundOutcome": "selectors",
    "make_selector": "selectors",
    "StrategyFeatureExtractor": "features",
    "Conv2dBlock": "workloads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
