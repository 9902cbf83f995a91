"""loop.cli: a user's mistake (a UserError) ends with one line; any other exception is a bug and keeps its traceback."""

from dataclasses import dataclass

import pytest

from rlkit import loop
from rlkit.errors import ConfigError


@dataclass
class Config:
    lr: float = 0.1
    """learning rate"""


def bad_flag(cfg):
    raise ConfigError(f"--lr {cfg.lr} must be below 0.01; pass --lr 0.001")


def shape_bug(cfg):  # what a forked recipe's loss does with mismatched shapes
    raise ValueError("operands could not be broadcast together with shapes (8,3) (8,4)")


def test_user_error_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["recipe.py", "--lr", "0.5"])
    monkeypatch.delenv("RLKIT_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as info:
        loop.cli(bad_flag, Config)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "rlkit: error: --lr 0.5 must be below 0.01; pass --lr 0.001\n" in err
    assert "Traceback" not in err and "bad_flag" not in err


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["recipe.py"])
    with pytest.raises(ValueError, match="could not be broadcast") as info:
        loop.cli(shape_bug, Config)
    assert info.traceback[-1].name == "shape_bug"  # raised as is, from where it happened
    assert "rlkit: error" not in capsys.readouterr().err


def test_rlkit_traceback_shows_a_user_errors_traceback(monkeypatch):
    monkeypatch.setattr("sys.argv", ["recipe.py"])
    monkeypatch.setenv("RLKIT_TRACEBACK", "1")
    with pytest.raises(ConfigError):
        loop.cli(bad_flag, Config)
