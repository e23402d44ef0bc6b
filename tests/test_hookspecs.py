"""Every hook spec, called through the typed manager facade with the built-in plugins.

Each spec has at least one ``test_hook_<spec name>`` test here (enforced by
``test_every_spec_has_a_hook_test``, datasette style).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import attrs
import msgpack
import pytest

from kvpush import hookimpl
from kvpush.core import hookspecs, wire
from kvpush.core.errors import ConfigError, HandshakeError, PluginError, WireError
from kvpush.core.manager import KvpushPluginManager
from kvpush.core.types import (
    HandshakeMode,
    LayoutProvider,
    Notification,
    NotificationKind,
    ParallelConfig,
    PushJob,
    PushRegistration,
    RankKey,
    ReadSpec,
    RegionAlignment,
    RequestMetadata,
    Role,
    TransferParams,
    TransportProvider,
)
from kvpush.testing import make_agent_metadata

TESTS_DIR = Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent


def spec_names() -> list[str]:
    return list(hookspecs.__all__)


# ------------------------------------------------------------------------------ meta-tests


def test_all_lists_every_spec():
    marked = {
        name
        for name, obj in vars(hookspecs).items()
        if inspect.isfunction(obj) and hasattr(obj, "kvpush_spec")
    }
    assert marked == set(hookspecs.__all__)
    assert all(name.startswith("kvpush_") for name in marked)


@pytest.mark.parametrize("name", spec_names())
def test_every_spec_states_combining_rule(name):
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc, f"{name} has no docstring"
    assert "Combining rule:" in doc, f"{name}'s docstring does not state its combining rule"
    assert ":return:" in doc


def _hook_test_names() -> set[str]:
    names = set()
    for path in TESTS_DIR.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_"):
                names.add(node.name)
    return names


@pytest.mark.parametrize("name", spec_names())
def test_every_spec_has_a_hook_test(name):
    tests = _hook_test_names()
    wanted = f"test_hook_{name}"
    assert any(test == wanted or test.startswith(wanted + "_") for test in tests), (
        f"no test function named {wanted}[_...] in tests/"
    )


def test_every_hook_test_names_a_spec():
    specs = spec_names()
    for test in _hook_test_names():
        rest = test.removeprefix("test_hook_")
        assert any(rest == s or rest.startswith(s + "_") for s in specs), f"{test} names no hook spec"


@pytest.mark.parametrize("name", spec_names())
def test_facade_has_a_method_per_hook(name):
    method = getattr(KvpushPluginManager, name.removeprefix("kvpush_"), None)
    assert callable(method), f"KvpushPluginManager has no typed method for {name}"


@pytest.mark.parametrize("name", spec_names())
def test_every_spec_in_plugin_guide(name):
    guide = (REPO_ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
    assert f"{name}({params})" in guide, f"docs/plugins.md does not show {name}({params})"


# ------------------------------------------------------------------------------ helpers


def job(*, p_tp: int, p_rank: int, d_tp: int, attention: str = "mha") -> PushJob:
    local = make_agent_metadata(tp_size=p_tp, tp_rank=p_rank, attention=attention, num_kv_heads=4)
    return PushJob(local=local, decode_tp_size=d_tp, local_block_ids=[1, 2, 3], remote_block_ids=[7, 8, 9])


def request(*, p_tp: int, p_pp: int) -> RequestMetadata:
    params = TransferParams(
        remote_engine_id="p", remote_host="127.0.0.1", remote_port=5600, tp_size=p_tp, pp_size=p_pp
    )
    return RequestMetadata(request_id="req-1", block_ids=[4, 5], params=params)


# ------------------------------------------------------------------------------ transports / layouts


def test_hook_kvpush_transports_builtin_nixl(kvpush_pm):
    from kvpush.transports.nixl import NixlTransport

    providers = kvpush_pm.transports()
    assert providers["nixl"].create is NixlTransport
    assert kvpush_pm.transport("nixl").create is NixlTransport
    with pytest.raises(ConfigError, match=r"no transport named 'tcp'.*'nixl'"):
        kvpush_pm.transport("tcp")


def test_hook_kvpush_transports_new_and_clash(kvpush_pm_factory):
    class Loopback:
        @staticmethod
        @hookimpl
        def kvpush_transports():
            return [TransportProvider(name="loopback", create=dict)]

    class Impostor:
        @staticmethod
        @hookimpl
        def kvpush_transports():
            return [TransportProvider(name="nixl", create=dict)]

    assert kvpush_pm_factory(("loopback", Loopback)).transport("loopback").create is dict
    pm = kvpush_pm_factory(("impostor", Impostor))
    with pytest.raises(PluginError, match="transport named 'nixl'") as excinfo:
        pm.transports()
    assert "'impostor'" in str(excinfo.value)
    assert "'nixl'" in str(excinfo.value)
    assert "KVPUSH_DISABLE_PLUGINS" in str(excinfo.value)


def test_hook_kvpush_layouts_uniform_describes_tensors(kvpush_pm):
    from kvpush.layouts.uniform import allocate_kv_caches

    provider = kvpush_pm.layout("uniform")
    assert provider.allocate is not None and provider.demo_model is not None
    meta = make_agent_metadata(num_layers=4, pp_size=2, pp_rank=1, tp_size=2, tp_rank=1)
    caches = allocate_kv_caches(meta.model, meta.parallel, num_blocks=5)
    regions = provider.describe_regions(caches, meta.parallel, meta.model)
    assert [(r.layer_names, r.component) for r in regions] == [
        (("layers.2",), "K"),
        (("layers.2",), "V"),
        (("layers.3",), "K"),
        (("layers.3",), "V"),
    ]
    # 2 of 4 heads per TP rank, 16 tokens, head_dim 8, bfloat16
    assert {r.block_len for r in regions} == {2 * 16 * 8 * 2}
    assert {r.num_blocks for r in regions} == {5}
    assert regions[0].base_addr == caches["layers.2"][0].data_ptr()
    assert regions[1].base_addr == caches["layers.2"][1].data_ptr()
    with pytest.raises(ConfigError, match="no layout named 'paged'"):
        kvpush_pm.layout("paged")


def test_hook_kvpush_layouts_clash(kvpush_pm_factory):
    class Other:
        @staticmethod
        @hookimpl
        def kvpush_layouts():
            return [LayoutProvider(name="uniform", describe_regions=list)]

    with pytest.raises(PluginError, match="layout named 'uniform'") as excinfo:
        kvpush_pm_factory(("other", Other)).layouts()
    assert "'other'" in str(excinfo.value)
    assert "'uniform'" in str(excinfo.value)


# ------------------------------------------------------------------------------ handshake


def test_hook_kvpush_metadata_extensions_merge(kvpush_pm, kvpush_pm_factory):
    class Rack:
        @staticmethod
        @hookimpl
        def kvpush_metadata_extensions(local):
            return {"rack": f"r-{local.parallel.tp_rank}"}

    class Nic:
        @staticmethod
        @hookimpl
        def kvpush_metadata_extensions():
            return {"nic": "mlx5_0"}

    meta = make_agent_metadata(tp_size=2, tp_rank=1)
    assert kvpush_pm.metadata_extensions(meta) == {}
    pm = kvpush_pm_factory(("rack", Rack), ("nic", Nic))
    assert pm.metadata_extensions(meta) == {"rack": "r-1", "nic": "mlx5_0"}


def test_hook_kvpush_metadata_extensions_key_clash(kvpush_pm_factory):
    class A:
        @staticmethod
        @hookimpl
        def kvpush_metadata_extensions():
            return {"zone": "a"}

    class B:
        @staticmethod
        @hookimpl
        def kvpush_metadata_extensions():
            return {"zone": "b"}

    with pytest.raises(PluginError, match="metadata field 'zone'") as excinfo:
        kvpush_pm_factory(("a", A), ("b", B)).metadata_extensions(make_agent_metadata())
    assert "'a'" in str(excinfo.value)
    assert "'b'" in str(excinfo.value)


@pytest.mark.parametrize(
    ("role", "peer_role", "mode"),
    [
        (Role.DECODE, Role.PREFILL, HandshakeMode.NOTIF_ONLY),
        (Role.PREFILL, Role.DECODE, HandshakeMode.FULL),
    ],
)
def test_hook_kvpush_handshake_mode_builtin(kvpush_pm, role, peer_role, mode):
    assert kvpush_pm.handshake_mode(role, peer_role) is mode


def test_hook_kvpush_handshake_mode_first_result_wins(kvpush_pm_factory):
    class ExplicitPrefill:
        @staticmethod
        @hookimpl
        def kvpush_handshake_mode(role):
            return HandshakeMode.FULL if role is Role.PREFILL else None

    pm = kvpush_pm_factory(("p", ExplicitPrefill))
    assert pm.handshake_mode(Role.PREFILL, Role.DECODE) is HandshakeMode.FULL
    # None defers to the built-in policy, which keeps decode -> prefill notification-only.
    assert pm.handshake_mode(Role.DECODE, Role.PREFILL) is HandshakeMode.NOTIF_ONLY


def test_hook_kvpush_handshake_mode_decode_is_always_notif_only(kvpush_pm_factory):
    class FullDecode:
        @staticmethod
        @hookimpl
        def kvpush_handshake_mode(role):
            return HandshakeMode.FULL if role is Role.DECODE else None

    pm = kvpush_pm_factory(("full-decode", FullDecode))
    with pytest.raises(PluginError, match="'full-decode' chose a full handshake for decode"):
        pm.handshake_mode(Role.DECODE, Role.PREFILL)


def test_hook_kvpush_handshake_mode_none_is_error(kvpush_pm_factory):
    pm = kvpush_pm_factory(env={"KVPUSH_DISABLE_PLUGINS": "defaults"})
    with pytest.raises(PluginError, match="no plugin chose a handshake mode for decode → prefill"):
        pm.handshake_mode(Role.DECODE, Role.PREFILL)


def test_hook_kvpush_validate_peer_compatible(kvpush_pm):
    prefill = make_agent_metadata(role="prefill", tp_size=2)
    decode = make_agent_metadata(role="decode", tp_size=4, tp_rank=3)
    assert kvpush_pm.validate_peer(prefill, decode, HandshakeMode.FULL) == []
    assert kvpush_pm.validate_peer(decode, prefill, HandshakeMode.NOTIF_ONLY) == []
    kvpush_pm.check_peer(prefill, decode, HandshakeMode.FULL)


def test_hook_kvpush_validate_peer_collects_every_problem(kvpush_pm):
    local = make_agent_metadata(role="decode")
    peer = make_agent_metadata(role="decode", pp_size=2, num_layers=4, transport="tcp", engine_id="other")
    peer = attrs.evolve(peer, regions=[peer.regions[0], attrs.evolve(peer.regions[1], mem_type="VRAM")])
    problems = kvpush_pm.validate_peer(local, peer, HandshakeMode.FULL)
    assert len(problems) == 4
    joined = "\n".join(problems)
    assert "both sides are decode engines" in joined
    assert "peer uses transport 'tcp', this side 'nixl'" in joined
    assert "runs PP=2" in joined
    assert "mixes memory types ['DRAM', 'VRAM']" in joined
    # A notification-only handshake does not look at the peer's regions.
    assert len(kvpush_pm.validate_peer(local, peer, HandshakeMode.NOTIF_ONLY)) == 3
    with pytest.raises(HandshakeError, match=r"engine 'other' rank \(pp=0, tp=0\) is not compatible") as exc:
        kvpush_pm.check_peer(local, peer, HandshakeMode.FULL)
    assert all(problem in str(exc.value) for problem in problems)


def test_hook_kvpush_validate_peer_pp_window_too_far(kvpush_pm):
    stage = make_agent_metadata(role="prefill", num_layers=4, pp_size=2, pp_rank=1)
    short_decode = make_agent_metadata(role="decode", num_layers=3)  # 6 regions, stage needs 8
    (problem,) = kvpush_pm.validate_peer(stage, short_decode, HandshakeMode.FULL)
    assert "needs peer regions up to 8" in problem
    assert "advertises 6" in problem


def test_hook_kvpush_validate_peer_plugin_problem(kvpush_pm_factory):
    class NoVram:
        @staticmethod
        @hookimpl
        def kvpush_validate_peer(peer):
            return (
                [f"{peer.engine_id} uses VRAM"] if any(r.mem_type == "VRAM" for r in peer.regions) else None
            )

    pm = kvpush_pm_factory(("novram", NoVram))
    local = make_agent_metadata(role="prefill")
    assert pm.validate_peer(local, make_agent_metadata(role="decode"), HandshakeMode.FULL) == []
    vram = make_agent_metadata(role="decode", engine_id="gpu", mem_type="VRAM")
    assert pm.validate_peer(local, vram, HandshakeMode.FULL) == ["gpu uses VRAM"]


# ------------------------------------------------------------------------------ region mapping


def test_hook_kvpush_align_regions_identity(kvpush_pm):
    local = make_agent_metadata(role="prefill", tp_size=2)
    peer = make_agent_metadata(role="decode", tp_size=1)
    alignment = kvpush_pm.align_regions(local, peer)
    assert alignment == RegionAlignment(remote_indices=(0, 1, 2, 3), source="identity")


def test_hook_kvpush_align_regions_pp_slicing(kvpush_pm):
    # PP2 stage owning layer 1 of 4 (2 regions per layer); D advertises 8 regions.
    stage = make_agent_metadata(
        role="prefill", num_layers=4, pp_size=2, pp_rank=1, start_layer=1, end_layer=2
    )
    decode = make_agent_metadata(role="decode", num_layers=4)
    assert len(stage.regions) == 2
    assert len(decode.regions) == 8
    alignment = kvpush_pm.align_regions(stage, decode)
    assert alignment.remote_indices == (2, 3)
    assert alignment.source == "pp_slicing"
    # An even split: stage 1 of 2 owns layers 2-3 -> D regions 4..7; stage 0 -> 0..3.
    for pp_rank, expected in ((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))):
        even = make_agent_metadata(role="prefill", num_layers=4, pp_size=2, pp_rank=pp_rank)
        assert kvpush_pm.align_regions(even, decode).remote_indices == expected


def test_hook_kvpush_align_regions_mla_pp_slicing(kvpush_pm):
    stage = make_agent_metadata(role="prefill", attention="mla", num_layers=6, pp_size=3, pp_rank=2)
    decode = make_agent_metadata(role="decode", attention="mla", num_layers=6)
    assert kvpush_pm.align_regions(stage, decode).remote_indices == (4, 5)


def test_hook_kvpush_align_regions_claim_conflict(kvpush_pm_factory):
    class Greedy:
        @staticmethod
        @hookimpl
        def kvpush_align_regions(local):
            return RegionAlignment(remote_indices=range(len(local.regions)))

    stage = make_agent_metadata(role="prefill", num_layers=4, pp_size=2, pp_rank=1)
    decode = make_agent_metadata(role="decode", num_layers=4)
    pm = kvpush_pm_factory(("greedy", Greedy))
    with pytest.raises(PluginError, match="both claim the region alignment") as excinfo:
        pm.align_regions(stage, decode)
    assert "'greedy'" in str(excinfo.value)
    assert "'pp_slicing'" in str(excinfo.value)
    # Alone (PP slicing does not apply without PP), the claim wins and carries its source.
    flat = make_agent_metadata(role="prefill")
    assert pm.align_regions(flat, make_agent_metadata(role="decode")).source == "greedy"


def test_hook_kvpush_align_regions_unexplained_mismatch(kvpush_pm):
    local = make_agent_metadata(role="prefill", num_layers=4)
    peer = make_agent_metadata(role="decode", num_layers=3)
    with pytest.raises(HandshakeError, match=r"has 8 KV regions but .* advertises 6"):
        kvpush_pm.align_regions(local, peer)


def test_hook_kvpush_align_regions_out_of_range_claim(kvpush_pm_factory):
    class OffByOne:
        @staticmethod
        @hookimpl
        def kvpush_align_regions(local):
            return RegionAlignment(remote_indices=range(1, len(local.regions) + 1))

    pm = kvpush_pm_factory(("offbyone", OffByOne))
    with pytest.raises(HandshakeError, match="alignment from 'offbyone' names peer region 4"):
        pm.align_regions(make_agent_metadata(role="prefill"), make_agent_metadata(role="decode"))


# ------------------------------------------------------------------------------ read specs


def test_hook_kvpush_build_read_specs_tp_1_to_2(kvpush_pm):
    specs = kvpush_pm.build_read_specs(job(p_tp=1, p_rank=0, d_tp=2))
    assert specs == [
        ReadSpec(dst_tp_rank=0, local_block_ids=[1, 2, 3], remote_block_ids=[7, 8, 9], local_part=(0, 2)),
        ReadSpec(dst_tp_rank=1, local_block_ids=[1, 2, 3], remote_block_ids=[7, 8, 9], local_part=(1, 2)),
    ]
    assert all(spec.remote_part == (0, 1) for spec in specs)


def test_hook_kvpush_build_read_specs_tp_2_to_1(kvpush_pm):
    for rank in (0, 1):
        (spec,) = kvpush_pm.build_read_specs(job(p_tp=2, p_rank=rank, d_tp=1))
        assert spec.dst_tp_rank == 0
        assert spec.local_part == (0, 1)
        assert spec.remote_part == (rank, 2)
        assert spec.local_block_ids == ((1, 2, 3),)
        assert spec.remote_block_ids == ((7, 8, 9),)


def test_hook_kvpush_build_read_specs_tp_2_to_2(kvpush_pm):
    for rank in (0, 1):
        (spec,) = kvpush_pm.build_read_specs(job(p_tp=2, p_rank=rank, d_tp=2))
        assert (spec.dst_tp_rank, spec.local_part, spec.remote_part) == (rank, (0, 1), (0, 1))


def test_hook_kvpush_build_read_specs_tp_4_to_2(kvpush_pm):
    dsts = [
        (spec.dst_tp_rank, spec.remote_part)
        for rank in range(4)
        for spec in kvpush_pm.build_read_specs(job(p_tp=4, p_rank=rank, d_tp=2))
    ]
    assert dsts == [(0, (0, 2)), (0, (1, 2)), (1, (0, 2)), (1, (1, 2))]


@pytest.mark.parametrize(
    ("p_tp", "p_rank", "d_tp", "dsts"),
    [
        (1, 0, 4, [0, 1, 2, 3]),
        (2, 1, 4, [2, 3]),
        (2, 1, 2, [1]),
        (4, 3, 2, [1]),
        (2, 0, 1, [0]),
    ],
)
def test_hook_kvpush_build_read_specs_mla_fan_out(kvpush_pm, p_tp, p_rank, d_tp, dsts):
    specs = kvpush_pm.build_read_specs(job(p_tp=p_tp, p_rank=p_rank, d_tp=d_tp, attention="mla"))
    assert [spec.dst_tp_rank for spec in specs] == dsts
    # The replicated latent is written whole to every destination: never a head slice.
    assert all(spec.local_part == (0, 1) and spec.remote_part == (0, 1) for spec in specs)


def test_hook_kvpush_build_read_specs_errors(kvpush_pm, kvpush_pm_factory):
    with pytest.raises(ConfigError, match="prefill TP 2 and decode TP 3 must divide one another"):
        kvpush_pm.build_read_specs(job(p_tp=2, p_rank=0, d_tp=3))
    mixed = job(p_tp=1, p_rank=0, d_tp=1)
    regions = [mixed.local.regions[0], attrs.evolve(mixed.local.regions[1], replicate=True)]
    mixed = attrs.evolve(mixed, local=attrs.evolve(mixed.local, regions=regions))
    with pytest.raises(ConfigError, match="mixing replicated"):
        kvpush_pm.build_read_specs(mixed)

    class Nowhere:
        @staticmethod
        @hookimpl(tryfirst=True)
        def kvpush_build_read_specs():
            return []

    with pytest.raises(PluginError, match="produced no destination"):
        kvpush_pm_factory(("nowhere", Nowhere)).build_read_specs(job(p_tp=1, p_rank=0, d_tp=1))
    no_tp = kvpush_pm_factory(env={"KVPUSH_DISABLE_PLUGINS": "tp_mapping"})
    with pytest.raises(PluginError, match="'tp_mapping' plugin disabled"):
        no_tp.build_read_specs(job(p_tp=1, p_rank=0, d_tp=1))


def test_hook_kvpush_transfer_strategy(kvpush_pm, kvpush_pm_factory):
    the_job = job(p_tp=1, p_rank=0, d_tp=1)
    (spec,) = kvpush_pm.build_read_specs(the_job)
    assert kvpush_pm.transfer_strategy(the_job, spec, 10_000) == "direct"

    class PackMany:
        @staticmethod
        @hookimpl
        def kvpush_transfer_strategy(num_descriptors):
            return "packed" if num_descriptors > 1000 else None

    pm = kvpush_pm_factory(("pack", PackMany))
    assert pm.transfer_strategy(the_job, spec, 10_000) == "packed"
    assert pm.transfer_strategy(the_job, spec, 10) == "direct"

    class Bogus:
        @staticmethod
        @hookimpl
        def kvpush_transfer_strategy():
            return "teleport"

    with pytest.raises(PluginError, match="unknown transfer strategy 'teleport'"):
        kvpush_pm_factory(("bogus", Bogus)).transfer_strategy(the_job, spec, 1)


# ------------------------------------------------------------------------------ completion


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_rank", "expected"),
    [
        (1, 1, 1, 0, {(0, 0)}),
        (2, 1, 1, 0, {(0, 0), (0, 1)}),
        (1, 1, 2, 1, {(0, 0)}),
        (4, 1, 2, 1, {(0, 2), (0, 3)}),
        (2, 2, 4, 3, {(0, 1), (1, 1)}),
        (4, 2, 1, 0, {(pp, tp) for pp in range(2) for tp in range(4)}),
    ],
)
def test_hook_kvpush_expected_producers(kvpush_pm, p_tp, p_pp, d_tp, d_rank, expected):
    prefill = ParallelConfig(tp_size=p_tp, pp_size=p_pp, num_layers=8)
    producers = kvpush_pm.expected_producers(prefill, d_rank, d_tp)
    assert {(p.pp_rank, p.tp_rank) for p in producers} == expected
    # one rule for both sides: every producer a D rank waits for lists that D rank among the
    # destinations it writes, and no other producer does
    from kvpush.core.producers import destinations

    for pp in range(p_pp):
        for tp in range(p_tp):
            writes_here = d_rank in destinations(tp, p_tp, d_tp)
            assert (RankKey(pp, tp) in producers) == writes_here


def test_hook_kvpush_expected_producers_plugin(kvpush_pm_factory):
    class StageZeroOnly:
        @staticmethod
        @hookimpl
        def kvpush_expected_producers(prefill):
            return [RankKey(0, 0)]

    class OutOfRange:
        @staticmethod
        @hookimpl
        def kvpush_expected_producers():
            return [RankKey(5, 0)]

    prefill = ParallelConfig(tp_size=1, pp_size=3, num_layers=6)
    assert kvpush_pm_factory(("z", StageZeroOnly)).expected_producers(prefill, 0, 1) == {RankKey(0, 0)}
    with pytest.raises(PluginError, match="inside P's PP 3 x TP 1"):
        kvpush_pm_factory(("o", OutOfRange)).expected_producers(prefill, 0, 1)


def test_hook_kvpush_decode_notification_round_trips(kvpush_pm):
    reg = PushRegistration(
        request_id="d-req",
        match_key="xfer-1",
        decode_engine_id="decode-0",
        decode_host="10.0.0.2",
        decode_port=5601,
        decode_tp_size=2,
        block_ids=[[3, 4], [9]],
        remote_engine_id="prefill-0",
    )
    note = kvpush_pm.decode_notification(wire.encode_push_reg(reg))
    assert note == Notification(kind=NotificationKind.PUSH_REG, request_id="d-req", registration=reg)

    done = kvpush_pm.decode_notification(wire.encode_done("d-req", RankKey(1, 3), 4))
    assert done == Notification(
        kind=NotificationKind.DONE, request_id="d-req", producer=RankKey(1, 3), producer_tp_size=4
    )
    failed = kvpush_pm.decode_notification(wire.encode_failed("d-req", RankKey(0, 1), "NIXL said no"))
    assert failed == Notification(
        kind=NotificationKind.FAILED,
        request_id="d-req",
        producer=RankKey(0, 1),
        reason="NIXL said no",
        unsettled=True,
    )
    cancel = kvpush_pm.decode_notification(wire.encode_cancel("xfer-1"))
    assert cancel == Notification(kind=NotificationKind.CANCEL, request_id="xfer-1")
    heartbeat = kvpush_pm.decode_notification(wire.encode_heartbeat(["a", "b"]))
    assert heartbeat == Notification(kind=NotificationKind.HEARTBEAT, request_ids=("a", "b"))
    assert kvpush_pm.decode_notification(b"somebody else's message") is None


def pack(obj: object) -> bytes:
    if isinstance(obj, dict):
        obj = {**obj, "v": [2, 0]}  # the current notification format
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (b"DONE:\xc1", "DONE is not valid msgpack"),
        (b"DONE:" + pack([1, 2]), "DONE body must be a map"),
        (b"DONE:" + pack({"pp": 0, "tp": 0}), "DONE field 'request_id' must be a non-empty string"),
        (b"DONE:" + pack({"request_id": "r", "pp": -1, "tp": 0, "ptp": 1}), "DONE field 'pp'"),
        (b"FAIL:" + pack({"request_id": "r", "pp": 0, "tp": True}), "FAIL field 'tp'"),
        (b"CANCEL:" + pack({"request_id": ""}), "CANCEL field 'request_id'"),
        (b"HB:" + pack({"request_ids": "r"}), "HB field 'request_ids' must be a list of at most"),
        (b"PUSH_REG:" + pack({"request_id": "r"}), "PUSH_REG field 'match_key'"),
        (
            b"PUSH_REG:"
            + pack(
                {
                    "request_id": "r",
                    "match_key": "m",
                    "decode_engine_id": "d",
                    "decode_host": "h",
                    "decode_port": 1,
                    "decode_tp_size": 1,
                    "tp": 0,
                    "local_block_ids": [[1, -2]],
                    "remote_engine_id": "p",
                }
            ),
            "PUSH_REG field 'local_block_ids' holds -2",
        ),
    ],
)
def test_hook_kvpush_decode_notification_malformed(kvpush_pm, message, match):
    with pytest.raises(WireError, match=match):
        kvpush_pm.decode_notification(message)


def test_hook_kvpush_decode_notification_custom_format(kvpush_pm_factory):
    class Legacy:
        @staticmethod
        @hookimpl
        def kvpush_decode_notification(message):
            if not message.startswith(b"OLD_DONE "):
                return None
            return Notification(kind=NotificationKind.DONE, request_id=message.split()[1].decode())

    pm = kvpush_pm_factory(("legacy", Legacy))
    assert pm.decode_notification(b"OLD_DONE r7") == Notification(kind=NotificationKind.DONE, request_id="r7")
    # kvpush's own format still reaches the built-in decoder (it runs first).
    assert pm.decode_notification(wire.encode_cancel("k")).kind is NotificationKind.CANCEL


def test_a_decoder_plugin_never_sees_kvpushs_own_messages(kvpush_pm_factory):
    """A plugin for another format is asked only about messages kvpush does not decode: one
    asked first could take a DONE or FAIL for its own (here: any message naming a DONE)."""
    seen: list[bytes] = []

    class Greedy:
        @staticmethod
        @hookimpl
        def kvpush_decode_notification(message):
            seen.append(message)
            if b"DONE" in message:  # its own "OLD_DONE <id>" format, matched too loosely
                return Notification(kind=NotificationKind.DONE, request_id="theirs")
            return None

    pm = kvpush_pm_factory(("greedy", Greedy))
    done = pm.decode_notification(wire.encode_done("d-req", RankKey(0, 0), 1))
    failed = pm.decode_notification(wire.encode_failed("d-req", RankKey(0, 0), "WRITE not DONE"))
    assert (done.kind, done.request_id) == (NotificationKind.DONE, "d-req")
    assert (failed.kind, failed.request_id) == (NotificationKind.FAILED, "d-req")
    assert seen == []
    assert pm.decode_notification(b"OLD_DONE r7").request_id == "theirs" and seen == [b"OLD_DONE r7"]
