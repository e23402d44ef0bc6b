"""``kvpush demo --transport NAME [--transport-option KEY=VALUE]``: parsing, validation, and real
demo runs that verify every byte and say which transport carried the WRITEs."""

from __future__ import annotations

import json

import pytest

from kvpush.cli import build_parser, main
from kvpush.core.errors import ConfigError
from kvpush.demo.runner import RunConfig, carried_by, placement, placement_options, transport_notes

SMALL = ["--layout", "mha", "--requests", "4", "--max-blocks", "4", "--prefill-pp", "1", "--decode-tp", "1"]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_transport_options_become_the_run_config() -> None:
    args = build_parser().parse_args(
        [
            "demo",
            "--transport",
            "cuda_ipc",
            "--transport-option",
            "mode=ipc",
            "--transport-option",
            'inner_options={"ucx_error_handling_mode": "none"}',
            "--device",
            "cuda:0",
            "--decode-device",
            "cuda:1",
            "--ucx-tls",
            "tcp",
        ]
    )
    assert (args.device, args.decode_device) == ("cuda:0", "cuda:1")
    options = placement_options(args)
    assert options["transport"] == "cuda_ipc"
    # The UCX options are NIXL's: under inner_options of the wrapping transport, next to the given ones.
    assert options["transport_options"] == {
        "mode": "ipc",
        "inner_options": {"ucx_tls": "tcp", "ucx_error_handling_mode": "none"},
    }
    cfg = RunConfig(**options)
    assert placement(cfg) == "P at 127.0.0.1, D at 127.0.0.1; ucx_error_handling_mode=none, ucx_tls=tcp"


def test_default_transport_is_nixl_with_ucx_options_on_top() -> None:
    options = placement_options(build_parser().parse_args(["demo", "--ucx-tls", "tcp"]))
    assert options["transport"] == "nixl"
    assert options["transport_options"] == {"ucx_tls": "tcp"}


def test_transport_option_needs_key_and_value(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--transport-option", "mode"])
    assert exit_.value.code == 2
    assert "--transport-option: expected KEY=VALUE (e.g. mode=ipc), got 'mode'" in capsys.readouterr().err


def test_unknown_transport_lists_the_registered_ones(capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVPUSH_LOAD_PLUGINS", "")
    assert main(["demo", "--transport", "carrier-pigeon", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "unknown --transport 'carrier-pigeon'" in err
    assert "the registered transports are cuda_ipc, faulty, nixl" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--transport-option", "mode=ipc"],
            "mode=ipc needs P's and D's caches on a GPU (P and D on the CPU)",
        ),
        (["--transport-option", "mode=fast"], "mode='fast': cuda_ipc modes are auto, ipc, nixl"),
        (["--transport-option", "colour=red"], "unknown cuda_ipc option(s) colour"),
    ],
)
def test_cuda_ipc_options_that_cannot_work_fail_before_any_process_starts(capsys, options, message) -> None:
    assert main(["demo", "--transport", "cuda_ipc", *options, *SMALL]) == 2
    assert message in capsys.readouterr().err


def test_cuda_ipc_notes() -> None:
    (note,) = transport_notes("cuda_ipc", {}, "cpu", None)
    assert "P and D caches are on the CPU" in note and "inner transport (nixl)" in note
    assert transport_notes("cuda_ipc", {"mode": "ipc"}, "cuda:0", "cuda:1") == [
        "transport cuda_ipc, mode ipc"
    ]
    with pytest.raises(ConfigError, match=r"\(D on the CPU\)"):
        transport_notes("cuda_ipc", {"mode": "ipc"}, "cuda:0", "cpu")
    assert transport_notes("nixl", {}, "cpu", None) == []


def test_soak_refuses_a_transport_it_cannot_wrap(capsys) -> None:
    assert main(["demo", "--soak", "10", "--transport", "loopback"]) == 2
    assert "--soak runs the faulty transport over nixl or cuda_ipc" in capsys.readouterr().err
    assert main(["demo", "--soak", "10", "--transport", "cuda_ipc", "--transport-option", "mode=ipc"]) == 2


def test_carried_by_counts_ipc_copies_and_fallbacks() -> None:
    def stats(writes: int, **transport) -> dict:
        return {"counters": {"writes_posted": writes}, "transport": transport}

    both = carried_by(
        "cuda_ipc",
        [
            stats(5, name="cuda_ipc", inner="nixl", ipc_writes=5, fallbacks={}),
            stats(
                3, name="cuda_ipc", inner="nixl", ipc_writes=0, fallbacks={"D": "the peer is on another host"}
            ),
        ],
    )
    assert both["writes"] == {"cuda_ipc": 5, "nixl": 3}
    assert both["summary"] == (
        "cuda_ipc (5 WRITEs), nixl (3 WRITEs); cuda_ipc fell back: the peer is on another host"
    )
    assert carried_by("nixl", [stats(4, name="nixl", inner=None)])["writes"] == {"nixl": 4}
    assert (
        carried_by("faulty", [stats(2, name="faulty", inner="nixl")])["summary"]
        == "faulty over nixl (2 WRITEs)"
    )


def _demo_json(capsys, *argv: str) -> dict:
    code = main(["demo", *argv, *SMALL, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report
    (row,) = report["runs"]
    assert row["verified_requests"] == row["requests"] == 4 and row["failed_requests"] == 0
    assert sum(row["carried_by"]["writes"].values()) == row["writes"] > 0
    return row


def test_demo_over_nixl_named_explicitly(capsys) -> None:
    row = _demo_json(capsys, "--transport", "nixl")
    assert row["transport"] == "nixl"
    assert row["carried_by"]["writes"] == {"nixl": row["writes"]}


def test_demo_over_cuda_ipc_on_cpu_falls_back_to_nixl_and_says_so(capsys) -> None:
    row = _demo_json(capsys, "--transport", "cuda_ipc")
    assert row["transport"] == "cuda_ipc"
    assert row["carried_by"]["writes"] == {"nixl": row["writes"]}
    assert "cuda_ipc fell back: no VRAM registered on one side" in row["carried_by"]["summary"]


@pytest.mark.skipif(_cuda_count() < 1, reason="needs a CUDA GPU")
def test_demo_over_cuda_ipc_on_one_gpu(capsys) -> None:
    row = _demo_json(
        capsys, "--transport", "cuda_ipc", "--transport-option", "mode=ipc", "--device", "cuda:0"
    )
    assert row["carried_by"]["writes"] == {"cuda_ipc": row["writes"]}


@pytest.mark.skipif(_cuda_count() < 2, reason="needs two CUDA GPUs")
def test_demo_over_cuda_ipc_across_two_gpus(capsys) -> None:
    row = _demo_json(
        capsys,
        "--transport",
        "cuda_ipc",
        "--transport-option",
        "mode=ipc",
        "--device",
        "cuda:0",
        "--decode-device",
        "cuda:1",
    )
    assert row["devices"] == "P cuda:0, D cuda:1"
    assert row["carried_by"]["writes"] == {"cuda_ipc": row["writes"]}
