"""Per-store features plus a one-hot strategy feature, for the one shared XGBModel.

One model learns from three kinds of measurement: A (original layout), L+P (transform paid at
every call) and P (transform done at compile time). ``PerStoreFeature`` skips the annotated
layout-rewrite blocks of P, so P looks like a program without any transform; appending the
strategy to every per-store row lets the trees separate the three regimes instead of averaging
them.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.feature_extractor import PerStoreFeature, PyFeatureExtractor

from .strategies import Strategy, strategy_of

STRATEGY_ORDER = (Strategy.NL, Strategy.LR, Strategy.LC)


def with_strategy_columns(features: np.ndarray, strategy: Strategy) -> np.ndarray:
    """Append the one-hot strategy columns to every row of a per-store feature matrix."""
    onehot = np.zeros((features.shape[0], len(STRATEGY_ORDER)), dtype=features.dtype)
    onehot[:, STRATEGY_ORDER.index(strategy)] = 1
    return np.concatenate([features, onehot], axis=1)


@derived_object
class StrategyFeatureExtractor(PyFeatureExtractor):
    """PerStoreFeature with the candidate's strategy appended.

    The strategy of an L+P or P program is read from the program (see ``strategy_of``). A plain
    A program is taken as ``score_as``, which the tuning loop sets to the strategy of the
    current round: in an NL round the measured A programs are NL samples, and in every round
    the search scores plain A candidates as programs of the strategy being trained, since the
    model picks the A whose derived program is fastest under that strategy (the paper's C
    selects A from X's features).
    """

    def __init__(self) -> None:
        self.base = PerStoreFeature()
        self.score_as = Strategy.NL

    def extract_from(self, context, candidates):
        raw = self.base.extract_from(context, candidates)
        out = []
        for cand, feats in zip(candidates, raw):
            strategy = strategy_of(cand.sch)
            if strategy is Strategy.NL:
                strategy = self.score_as
            arr = feats.numpy()
            if arr.ndim != 2 or arr.shape[0] == 0:
                out.append(feats)
                continue
            out.append(tvm.runtime.tensor(with_strategy_columns(arr, strategy)))
        return out
