"""The draft replica's command line: its quantisation flag and environment variable are
checked before anything loads."""
import pytest

from draft_service.server import build_parser, main
from specdec.config import parse_args


def test_quantize_defaults_to_auto_and_reads_its_variable(monkeypatch):
    assert parse_args(build_parser(), []).quantize == "auto"
    monkeypatch.setenv("SPECDEC_QUANTIZE", "none")
    assert parse_args(build_parser(), []).quantize == "none"
    assert parse_args(build_parser(), ["--quantize", "int8"]).quantize == "int8"
    assert parse_args(build_parser(), ["--quantize", "w8a8"]).quantize == "w8a8"


@pytest.mark.parametrize("argv, env, words", [
    (["--quantize", "int4"], None, "argument --quantize: invalid choice: 'int4'"),
    ([], "int4", "SPECDEC_QUANTIZE='int4' is not a choice of --quantize (auto, none, int8, w8a8)"),
])
def test_a_bad_quantisation_is_a_usage_error(monkeypatch, capsys, argv, env, words):
    if env is not None:
        monkeypatch.setenv("SPECDEC_QUANTIZE", env)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err
