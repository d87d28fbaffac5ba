"""Tuning measures candidates through TVM's RPC tracker and server (on loopback)."""
import numpy as np
import pytest
import tvm
from tvm.rpc.server import Server
from tvm.rpc.tracker import Tracker
from tvm.s_tir import meta_schedule as ms

from tvm_einweld.auto_scheduler_ext import tune_tir
from tvm_einweld.auto_scheduler_ext.strategies import Strategy, strategy_of
from tvm_einweld.auto_scheduler_ext.workloads import Conv2dBlock

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
BLOCK = Conv2dBlock(1, 8, 8, 8, 8, 3, 1, 1)
KEY = "einweld-test"


@pytest.fixture()
def rpc():
    tracker = Tracker(host="127.0.0.1", port=9190, port_end=10190, silent=True)
    server = Server(host="127.0.0.1", port=10190, port_end=11190, key=KEY, silent=True,
                    tracker_addr=("127.0.0.1", tracker.port))
    try:
        yield tracker
    finally:
        server.terminate()
        tracker.terminate()


def test_tuning_through_rpc_runner(rpc, tmp_path):
    config = ms.runner.RPCConfig(tracker_host="127.0.0.1", tracker_port=rpc.port, tracker_key=KEY,
                                 session_timeout_sec=120)
    runner = ms.runner.RPCRunner(rpc_config=config, max_workers=1)
    rounds = []
    search = ms.search_strategy.EvolutionarySearch(population_size=16, init_min_unmeasured=4,
                                                   genetic_num_iters=1)
    db = tune_tir(BLOCK.module(), TARGET, str(tmp_path), max_trials_global=2, num_trials_per_iter=2,
                  runner=runner, search=search, early_stopping_rounds=5, seed=3,
                  on_round=lambda name, o: rounds.append(o))
    assert len(rounds) == 1 and rounds[0].failures == 0  # every candidate ran on the server
    assert rounds[0].strategy is Strategy.LR  # 1 round of 1 under the 5:5:6 rule
    sch = db.query_schedule(BLOCK.module(), TARGET, workload_name="main")
    assert strategy_of(sch) is Strategy.LC
    inputs = BLOCK.random_inputs(seed=8)
    out = tvm.runtime.tensor(np.zeros(BLOCK.shapes()["out"], "float32"))
    tvm.tirx.build(sch.mod, target=TARGET)["main"](
        *(tvm.runtime.tensor(inputs[k]) for k in ("data", "weight", "bias")), out)
    np.testing.assert_allclose(out.numpy(), BLOCK.reference(**inputs), rtol=1e-4, atol=1e-4)


@pytest.fixture()
def two_servers():
    """A tracker with two loopback servers under one key: two runners, as two machines."""
    tracker = Tracker(host="127.0.0.1", port=9190, port_end=10190, silent=True)
    servers = [Server(host="127.0.0.1", port=10190, port_end=11190, key=KEY, silent=True,
                      tracker_addr=("127.0.0.1", tracker.port)) for _ in range(2)]
    try:
        yield tracker
    finally:
        for server in servers:
            server.terminate()
        tracker.terminate()


def test_two_rpc_servers_tune_as_the_local_runner_does(two_servers, tmp_path):
    """Two servers measuring at once (max_workers=2) and the local runner, on the same seeded
    run of two rounds: every candidate is measured on a server (no failures), as many records
    are written as locally, and the best record computes what the block computes.
    (MetaSchedule's sampling differs from run to run even with one seed, so the records are
    compared by count and validity, not trace by trace.)"""
    def tune(runner, folder):
        search = ms.search_strategy.EvolutionarySearch(population_size=16, init_min_unmeasured=4,
                                                       genetic_num_iters=1)
        rounds = []
        db = tune_tir(BLOCK.module(), TARGET, str(tmp_path / folder), max_trials_global=8,
                      num_trials_per_iter=4, runner=runner, search=search,
                      early_stopping_rounds=5, seed=3, on_round=lambda n, o: rounds.append(o))
        assert len(rounds) == 2 and all(o.failures == 0 for o in rounds)
        return db

    config = ms.runner.RPCConfig(tracker_host="127.0.0.1", tracker_port=two_servers.port,
                                 tracker_key=KEY, session_timeout_sec=120)
    remote = tune(ms.runner.RPCRunner(rpc_config=config, max_workers=2), "rpc")
    local = tune(ms.runner.LocalRunner(), "local")
    records = remote.get_all_tuning_records()
    assert len(records) == len(local.get_all_tuning_records()) >= 8
    assert all(len(r.run_secs) and min(float(t) for t in r.run_secs) < 1e9 for r in records)
    sch = remote.query_schedule(BLOCK.module(), TARGET, workload_name="main")
    inputs = BLOCK.random_inputs(seed=8)
    out = tvm.runtime.tensor(np.zeros(BLOCK.shapes()["out"], "float32"))
    tvm.tirx.build(sch.mod, target=TARGET)["main"](
        *(tvm.runtime.tensor(inputs[k]) for k in ("data", "weight", "bias")), out)
    np.testing.assert_allclose(out.numpy(), BLOCK.reference(**inputs), rtol=1e-4, atol=1e-4)
