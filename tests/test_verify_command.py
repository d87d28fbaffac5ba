"""`python -m tvm_einweld verify`: tables, and exit code 1 when the verifier is fooled."""
import argparse
import dataclasses

from tvm_einweld.commands import verify as command
from tvm_einweld.verify import mutations, selfcheck


def _run(argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def test_command_passes_and_prints_both_tables(capsys):
    assert _run([]) == 0
    out = capsys.readouterr().out
    n_ops = len(selfcheck._relax_cases()) + len(selfcheck._numpy_cases())
    assert n_ops >= 16 and f"{n_ops}/{n_ops} operators agree" in out
    planted = sum(not c.correct for c in mutations.suite())
    assert f"{planted}/{planted} planted mutations rejected" in out
    assert "off-by-one offset" in out and "swapped iterators of equal range" in out
    assert "WRONG VERDICT" not in out and "MISMATCH" not in out


def test_command_fails_when_a_planted_mutation_is_accepted(monkeypatch, capsys):
    real = mutations.verify_rewrite

    def fooled(before, after, side_conditions=(), **kw):
        return dataclasses.replace(real(before, after, side_conditions, **kw), ok=True)

    monkeypatch.setattr(mutations, "verify_rewrite", fooled)
    assert _run(["--only", "mutations"]) == 1
    out = capsys.readouterr().out
    assert "WRONG VERDICT" in out and "0/" in out and "Canonical operator" not in out
