"""The typed plugin-manager facade. Engines call these methods, never ``pm.hook`` directly."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import pluggy

from kvpush.core import hookspecs
from kvpush.core.errors import ConfigError, HandshakeError, KvpushError, PluginError
from kvpush.core.markers import PROJECT_NAME
from kvpush.core.types import (
    AgentMetadata,
    HandshakeMode,
    LayoutProvider,
    Notification,
    ParallelConfig,
    PushJob,
    RankKey,
    ReadSpec,
    RegionAlignment,
    Role,
    TransportProvider,
)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_ENV = "KVPUSH_DISABLE_PLUGINS"
LOAD_ENV = "KVPUSH_LOAD_PLUGINS"

BUILTIN_PLUGINS: dict[str, str] = {
    "defaults": "kvpush.plugins.defaults",
    "tp_mapping": "kvpush.plugins.tp_mapping",
    "pp_slicing": "kvpush.plugins.pp_slicing",
    "mla_replication": "kvpush.plugins.mla_replication",
    "block_order": "kvpush.plugins.block_order",
    "strategy": "kvpush.plugins.strategy",
    "nixl": "kvpush.transports.nixl",
    "faulty": "kvpush.transports.faulty",
    "cuda_ipc": "kvpush.transports.cuda_ipc",
    "uniform": "kvpush.layouts.uniform",
    "hma": "kvpush.layouts.hma",
    "token_major": "kvpush.layouts.token_major",
    "vllm": "kvpush.layouts.vllm",
}
"""Short name → module of every built-in plugin, registered like any third-party plugin."""

STRATEGIES = ("direct", "packed")


@attrs.frozen(kw_only=True)
class PluginInfo:
    """One registered plugin, as ``kvpush plugins`` reports it."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


def _split_env(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


class KvpushPluginManager:
    """A pluggy manager with one typed method per kvpush hook."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._dists: dict[str, tuple[str, str]] = {}
        self._producers_memo: dict[tuple[ParallelConfig, int, int], frozenset[RankKey]] = {}
        self._producers_impls: list[Any] = []
        self._plain_exec = self.pm._inner_hookexec
        """pluggy's own call loop (``enable_tracing`` and call monitoring replace it)."""
        self._direct: dict[str, tuple[list[Any], Any, tuple[tuple[Any, tuple[str, ...]], ...] | None]] = {}
        """Hook name -> (its implementations, the call loop, what :meth:`_direct_calls` found)."""

    # ---------------------------------------------------------------- registration

    def register(self, plugin: object, name: str, distribution: tuple[str, str] | None = None) -> None:
        """Register ``plugin`` (a module or object with hookimpls) under ``name``."""
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as err:
            dist, version = distribution or ("kvpush", _kvpush_version())
            raise PluginError(
                f"plugin {name!r} (distribution {dist} {version}) is invalid: {err}. "
                f"Fix its hookimpls to match the specs in kvpush.core.hookspecs."
            ) from err
        except ValueError as err:
            raise PluginError(f"plugin {name!r} could not be registered: {err}") from err
        self._dists[name] = distribution or ("kvpush", _kvpush_version())

    def check_pending(self) -> None:
        """Fail on any hookimpl whose name matches no spec (usually a typo)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as err:
            name = self.pm.get_name(err.plugin) or repr(err.plugin)
            dist, version = self._dists.get(name, ("unknown", "?"))
            known = ", ".join(sorted(hookspecs.__all__))
            raise PluginError(
                f"plugin {name!r} (distribution {dist} {version}): {err}. kvpush hooks are: "
                f"{known}. Rename the function or remove its @hookimpl."
            ) from err

    def load_entrypoints(self, allow: Sequence[str] | None, blocked: Sequence[str]) -> int:
        """Load plugins from the ``kvpush`` entry-point group; return how many were loaded."""
        loaded = 0
        installed: set[str] = set()
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                dist_name = dist.metadata["Name"] or "unknown"
                installed.update({ep.name, dist_name})  # allowed but disabled is not "missing"
                if ep.name in blocked or dist_name in blocked:
                    logger.info("kvpush plugin %s (%s) disabled by %s", ep.name, dist_name, DISABLE_ENV)
                    continue
                if allow is not None and ep.name not in allow and dist_name not in allow:
                    continue
                if self.pm.get_plugin(ep.name) is not None:
                    other, other_version = self._dists.get(ep.name, ("unknown", "?"))
                    if other == dist_name:
                        continue  # the same distribution found twice on sys.path
                    raise PluginError(
                        f"plugin {ep.name!r} from distribution {dist_name} {dist.version} has the "
                        f"name of the plugin already registered from {other} {other_version}; "
                        f"rename its entry point, or skip it with {DISABLE_ENV}={dist_name}"
                    )
                try:
                    plugin = ep.load()
                except Exception as err:
                    raise PluginError(
                        f"plugin {ep.name!r} from distribution {dist_name} {dist.version} failed "
                        f"to import ({ep.value}): {type(err).__name__}: {err}. Reinstall or fix "
                        f"it, or skip it with {DISABLE_ENV}={ep.name}."
                    ) from err
                self.register(plugin, ep.name, (dist_name, dist.version))
                loaded += 1
        for name in allow or ():
            if name not in installed and name not in BUILTIN_PLUGINS:
                raise PluginError(
                    f"{LOAD_ENV} names {name!r}, but no installed distribution offers a "
                    f"{ENTRY_POINT_GROUP!r} entry point by that name; install it or remove it."
                )
        return loaded

    # ---------------------------------------------------------------- introspection

    def list_plugins(self) -> list[PluginInfo]:
        infos = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            dist, version = self._dists.get(name, ("unknown", "?"))
            hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or ())
            infos.append(PluginInfo(name=name, distribution=dist, version=version, hooks=tuple(hooks)))
        return sorted(infos, key=lambda info: info.name)

    def _results_with_source(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call each implementation of a hook separately, keeping which plugin answered."""
        caller = getattr(self.pm.hook, hook_name)
        out = []
        for impl in reversed(caller.get_hookimpls()):  # pluggy's own LIFO call order
            if impl.wrapper or impl.hookwrapper:
                continue  # wrappers need pluggy's call loop; these hooks are called impl by impl
            args = {name: kwargs[name] for name in impl.argnames}
            try:
                result = impl.function(**args)
            except (KvpushError, KeyboardInterrupt):
                raise  # a plugin's own refusal names what is wrong
            except BaseException as err:  # SystemExit too: it must not end the writer's round
                raise _raised(impl.plugin_name, hook_name, err) from err
            if result is not None:
                out.append((impl.plugin_name, result))
        return out

    def _providers(self, hook_name: str, kind: str, cls: type) -> dict[str, Any]:
        found: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for plugin_name, results in self._results_with_source(hook_name):
            if not isinstance(results, Iterable) or isinstance(results, (str, bytes)):
                raise _returned(plugin_name, hook_name, results, f"an iterable of {cls.__name__}")
            for provider in results:
                if not isinstance(provider, cls):
                    raise _returned(plugin_name, hook_name, provider, f"{cls.__name__} objects")
                if provider.name in found:
                    raise PluginError(
                        f"two plugins offer a {kind} named {provider.name!r}: "
                        f"{owner[provider.name]!r} and {plugin_name!r}. Disable one with "
                        f"{DISABLE_ENV}, and report the clash to the plugin authors."
                    )
                found[provider.name] = provider
                owner[provider.name] = plugin_name
        return found

    # ---------------------------------------------------------------- transports and layouts

    def transports(self) -> dict[str, TransportProvider]:
        return self._providers("kvpush_transports", "transport", TransportProvider)

    def layouts(self) -> dict[str, LayoutProvider]:
        return self._providers("kvpush_layouts", "layout", LayoutProvider)

    def transport(self, name: str) -> TransportProvider:
        providers = self.transports()
        if name not in providers:
            raise ConfigError(
                f"no transport named {name!r}; available: {sorted(providers)}. "
                f"Install the plugin that provides it."
            )
        return providers[name]

    def layout(self, name: str) -> LayoutProvider:
        providers = self.layouts()
        if name not in providers:
            raise ConfigError(
                f"no layout named {name!r}; available: {sorted(providers)}. "
                f"Install the plugin that provides it."
            )
        return providers[name]

    # ---------------------------------------------------------------- handshake

    def metadata_extensions(self, local: AgentMetadata, reserved: Iterable[str] = ()) -> dict[str, Any]:
        """The plugins' fields, merged; ``reserved``: names kvpush publishes itself (refused)."""
        merged: dict[str, Any] = {}
        owner: dict[str, str] = {}
        reserved = frozenset(reserved)
        for plugin_name, extra in self._results_with_source("kvpush_metadata_extensions", local=local):
            if not isinstance(extra, Mapping):
                raise _returned(plugin_name, "kvpush_metadata_extensions", extra, "a mapping or None")
            for key, value in dict(extra).items():
                if key in reserved:
                    raise PluginError(
                        f"plugin {plugin_name!r} publishes metadata field {key!r} from "
                        f"kvpush_metadata_extensions, a field kvpush publishes itself "
                        f"({', '.join(sorted(reserved))}); prefix the plugin's keys with its name"
                    )
                if key in merged:
                    raise PluginError(
                        f"plugins {owner[key]!r} and {plugin_name!r} both publish metadata "
                        f"field {key!r}; one of them must rename it"
                    )
                merged[key] = value
                owner[key] = plugin_name
        return merged

    def handshake_mode(self, role: Role, peer_role: Role) -> HandshakeMode:
        for plugin_name, mode in self._results_with_source(
            "kvpush_handshake_mode", role=role, peer_role=peer_role
        ):
            required = HandshakeMode.NOTIF_ONLY if role is Role.DECODE else HandshakeMode.FULL
            if not isinstance(mode, HandshakeMode):
                raise _returned(plugin_name, "kvpush_handshake_mode", mode, "a HandshakeMode or None")
            if mode is not required:
                raise PluginError(
                    f"plugin {plugin_name!r} chose a {mode.value} handshake for {role.value} → "
                    f"{peer_role.value}; push mode needs {required.value} (D only sends "
                    f"notifications to P; P writes into D's memory)"
                )
            return mode
        raise PluginError(
            f"no plugin chose a handshake mode for {role.value} → {peer_role.value}; is the "
            f"'defaults' plugin disabled?"
        )

    def validate_peer(self, local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode) -> list[str]:
        results = self._call_hook("kvpush_validate_peer", {"local": local, "peer": peer, "mode": mode})
        problems: list[str] = []
        for result in results:
            if isinstance(result, str):  # one problem, not one per character
                problems.append(result)
            elif isinstance(result, Iterable):
                problems.extend(str(problem) for problem in result)
            else:
                kwargs = {"local": local, "peer": peer, "mode": mode}
                name = self._answered_by("kvpush_validate_peer", kwargs, _not_problems)
                problems.append(
                    f"plugin {name!r} returned {result!r} from kvpush_validate_peer, not a list of problems"
                )
        return problems

    def check_peer(self, local: AgentMetadata, peer: AgentMetadata, mode: HandshakeMode) -> None:
        """Raise one ``HandshakeError`` listing every problem the validators found."""
        problems = self.validate_peer(local, peer, mode)
        if problems:
            raise HandshakeError(
                f"engine {peer.engine_id!r} rank {peer.rank} is not compatible with "
                f"{local.engine_id!r} rank {local.rank}:\n  - " + "\n  - ".join(problems)
            )

    # ---------------------------------------------------------------- region mapping

    def align_regions(self, local: AgentMetadata, peer: AgentMetadata) -> RegionAlignment:
        claims = self._results_with_source("kvpush_align_regions", local=local, peer=peer)
        if len(claims) > 1:
            names = " and ".join(repr(name) for name, _ in claims)
            raise PluginError(
                f"plugins {names} both claim the region alignment of {local.engine_id!r} "
                f"{local.rank} with {peer.engine_id!r} {peer.rank}; disable one of them"
            )
        if claims:
            plugin_name, alignment = claims[0]
            if not isinstance(alignment, RegionAlignment):
                raise _returned(plugin_name, "kvpush_align_regions", alignment, "a RegionAlignment or None")
            alignment = attrs.evolve(alignment, source=plugin_name)
        else:
            if len(local.regions) != len(peer.regions):
                raise HandshakeError(
                    f"{local.engine_id!r} {local.rank} has {len(local.regions)} KV regions but "
                    f"{peer.engine_id!r} {peer.rank} advertises {len(peer.regions)}, and no "
                    f"alignment plugin (PP slicing, HMA) explains the difference; check that both "
                    f"sides run the same model and layout"
                )
            alignment = RegionAlignment(remote_indices=range(len(local.regions)))
        _check_alignment(local, peer, alignment)
        return alignment

    # ---------------------------------------------------------------- read specs

    def build_read_specs(self, job: PushJob) -> list[ReadSpec]:
        specs = self._first_result("kvpush_build_read_specs", {"job": job})
        if specs is None:
            raise PluginError("no plugin built read specs; is the 'tp_mapping' plugin disabled?")
        if not isinstance(specs, Iterable) or isinstance(specs, (str, bytes)):
            name = self._answered_by("kvpush_build_read_specs", {"job": job})
            raise _returned(name, "kvpush_build_read_specs", specs, "a list of ReadSpec or None")
        try:
            specs = list(specs)
        except (KvpushError, KeyboardInterrupt):
            raise
        except BaseException as err:  # a generator raising while it is listed
            name = self._answered_by("kvpush_build_read_specs", {"job": job})
            raise _raised(name, "kvpush_build_read_specs", err) from err
        if not specs:
            raise PluginError(
                f"the read-spec plugins produced no destination for a request of "
                f"{job.local.engine_id!r} {job.local.rank} (decode TP {job.decode_tp_size}); "
                f"the request could never complete"
            )
        local, remote = job.local_block_ids, job.remote_block_ids
        for spec in specs:
            if not isinstance(spec, ReadSpec):
                name = self._answered_by("kvpush_build_read_specs", {"job": job})
                raise PluginError(
                    f"read-spec plugin {name!r} returned {type(spec).__name__} {spec!r} in its list "
                    f"from kvpush_build_read_specs; return ReadSpec objects"
                )
            for part in (spec.local_part, spec.remote_part):
                if not (
                    type(part) is tuple
                    and len(part) == 2
                    and all(type(n) is int for n in part)
                    and 0 <= part[0] < part[1]
                ):
                    name = self._answered_by("kvpush_build_read_specs", {"job": job})
                    raise PluginError(
                        f"read-spec plugin {name!r} returned a part {part!r} from "
                        f"kvpush_build_read_specs for D rank {spec.dst_tp_rank}; a part is a tuple "
                        f"(index, count) of ints with 0 <= index < count"
                    )
            same_local = spec.local_block_ids is local or spec.local_block_ids == local
            if not (same_local and (spec.remote_block_ids is remote or spec.remote_block_ids == remote)):
                raise PluginError(
                    _block_ids_changed(self._answered_by("kvpush_build_read_specs", {"job": job}), job, spec)
                )
        return specs

    def _answered_by(
        self, hook_name: str, kwargs: Mapping[str, Any], which: Any = lambda result: result is not None
    ) -> str:
        """The plugin whose answer a first-result hook took, or the first whose answer
        ``which`` picks (error paths only: calls the implementations again)."""
        caller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            if impl.wrapper or impl.hookwrapper:
                continue
            try:
                if which(impl.function(**{name: kwargs[name] for name in impl.argnames})):
                    return impl.plugin_name
            except Exception:
                return impl.plugin_name
        return "?"

    def transfer_strategy(self, job: PushJob, spec: ReadSpec, num_descriptors: int) -> str:
        name = self._first_result(
            "kvpush_transfer_strategy", {"job": job, "spec": spec, "num_descriptors": num_descriptors}
        )
        if name is None:
            return "direct"
        if not isinstance(name, str) or name not in STRATEGIES:
            kwargs = {"job": job, "spec": spec, "num_descriptors": num_descriptors}
            plugin = self._answered_by("kvpush_transfer_strategy", kwargs)
            raise PluginError(
                f"plugin {plugin!r} chose unknown transfer strategy {name!r} in "
                f"kvpush_transfer_strategy; use one of {STRATEGIES}, or None: {_fix(plugin)}"
            )
        return name

    # ---------------------------------------------------------------- completion

    def expected_producers(
        self, prefill: ParallelConfig, decode_tp_rank: int, decode_tp_size: int
    ) -> frozenset[RankKey]:
        """The producers a D rank waits for (``kvpush_expected_producers``), checked.

        A rule of configuration (P's published parallel config and D's TP), so answers are
        memoised while the hook's implementations stay the same (P asks on every plan)."""
        caller = self.pm.hook.kvpush_expected_producers
        impls = caller.get_hookimpls()
        key = (prefill, decode_tp_rank, decode_tp_size)
        if self._producers_impls != impls:
            self._producers_memo.clear()
            self._producers_impls = impls
        hit = self._producers_memo.get(key)
        if hit is not None:
            return hit
        producers = self._expected_producers(prefill, decode_tp_rank, decode_tp_size)
        if len(self._producers_memo) >= 1024:
            self._producers_memo.clear()
        self._producers_memo[key] = producers
        return producers

    def _expected_producers(
        self, prefill: ParallelConfig, decode_tp_rank: int, decode_tp_size: int
    ) -> frozenset[RankKey]:
        kwargs = {"prefill": prefill, "decode_tp_rank": decode_tp_rank, "decode_tp_size": decode_tp_size}
        result = self._call_hook("kvpush_expected_producers", kwargs)
        try:
            producers = frozenset(() if result is None else result)
        except TypeError:
            producers = frozenset()  # not an iterable: refused below
        bad = [
            p
            for p in producers
            if not isinstance(p, RankKey) or p.pp_rank >= prefill.pp_size or p.tp_rank >= prefill.tp_size
        ]
        if not producers or bad or isinstance(result, (str, bytes)):
            who = "every expected-producer plugin"
            if result is not None:
                who = f"expected-producer plugin {self._answered_by('kvpush_expected_producers', kwargs)!r}"
            raise PluginError(
                f"{who} returned {result!r} from kvpush_expected_producers for D rank {decode_tp_rank}/"
                f"{decode_tp_size}; a non-empty set of RankKey inside P's PP {prefill.pp_size} x "
                f"TP {prefill.tp_size} is needed"
            )
        return producers

    def decode_notification(self, message: bytes) -> Notification | None:
        calls = self._direct_calls("kvpush_decode_notification")
        note = None
        try:
            if calls is None:
                note = self.pm.hook.kvpush_decode_notification(message=message)
            else:
                for function, _ in calls:  # first result wins, in pluggy's order
                    note = function(message)
                    if note is not None:
                        break
        except (KvpushError, KeyboardInterrupt):
            raise
        except BaseException as err:  # SystemExit too: the rest of the batch must still be read
            raise self._culprit("kvpush_decode_notification", {"message": message}, err) from err
        if note is not None and not isinstance(note, Notification):
            plugin = self._answered_by("kvpush_decode_notification", {"message": message})
            raise _returned(plugin, "kvpush_decode_notification", note, "a Notification or None")
        return note

    def _call_hook(self, hook_name: str, kwargs: dict[str, Any]) -> Any:
        """Call a hook through pluggy; a plugin's non-kvpush exception becomes a
        ``PluginError`` naming the plugin and the hook (:meth:`_culprit`)."""
        try:
            return getattr(self.pm.hook, hook_name)(**kwargs)
        except (KvpushError, KeyboardInterrupt):
            raise
        except BaseException as err:  # SystemExit too: it must not end the writer's round
            raise self._culprit(hook_name, kwargs, err) from err

    def _first_result(self, hook_name: str, kwargs: dict[str, Any]) -> Any:
        """A ``firstresult`` hook's answer: its implementations called in turn while pluggy's
        call loop would do nothing more (:meth:`_direct_calls`), else through pluggy."""
        calls = self._direct_calls(hook_name)
        try:
            if calls is None:
                return getattr(self.pm.hook, hook_name)(**kwargs)
            for function, argnames in calls:
                result = function(*[kwargs[name] for name in argnames])
                if result is not None:
                    return result
        except (KvpushError, KeyboardInterrupt):
            raise  # a plugin's own refusal (tp_mapping's ConfigError) names what is wrong
        except BaseException as err:  # SystemExit too: it must not end the writer's round
            raise self._culprit(hook_name, kwargs, err) from err
        return None

    def _culprit(self, hook_name: str, kwargs: Mapping[str, Any], err: BaseException) -> PluginError:
        """A ``PluginError`` naming the plugin whose implementation raised ``err`` (error path:
        found from the traceback, the frames of each implementation's function)."""
        codes = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            function = getattr(impl.function, "__func__", impl.function)
            code = getattr(function, "__code__", None)
            if code is not None:
                codes[code] = impl.plugin_name
        name = "?"
        tb = err.__traceback__
        while tb is not None:
            name = codes.get(tb.tb_frame.f_code, name)
            tb = tb.tb_next
        return _raised(name, hook_name, err)

    def _direct_calls(self, hook_name: str) -> tuple[tuple[Any, tuple[str, ...]], ...] | None:
        """``(function, argument names)`` of a hook's implementations in pluggy's call order,
        to be called without pluggy's call loop on hot paths; None while the loop does more
        than call them in turn (a wrapper, keyword-only arguments, tracing or monitoring), and
        then the hook goes through pluggy. Recomputed whenever the implementations change, so
        a plugin registered later is called exactly as pluggy would call it."""
        caller = getattr(self.pm.hook, hook_name)
        impls = caller.get_hookimpls()
        loop = self.pm._inner_hookexec
        hit = self._direct.get(hook_name)
        if hit is not None and hit[1] is loop and hit[0] == impls:
            return hit[2]
        calls: tuple[tuple[Any, tuple[str, ...]], ...] | None = tuple(
            (impl.function, tuple(impl.argnames)) for impl in reversed(impls)
        )
        if loop is not self._plain_exec or any(
            impl.wrapper or impl.hookwrapper or impl.kwargnames for impl in impls
        ):
            calls = None
        self._direct[hook_name] = (impls, loop, calls)
        return calls


def _not_problems(result: Any) -> bool:
    return result is not None and not isinstance(result, Iterable)


def _fix(plugin: str) -> str:
    if plugin in BUILTIN_PLUGINS:
        return "this is a kvpush bug: report it with the traceback"
    return f"fix the plugin, or skip it with {DISABLE_ENV}={plugin} on both engines"


def _raised(plugin: str, hook_name: str, err: BaseException) -> PluginError:
    return PluginError(f"plugin {plugin!r} raised {type(err).__name__} in {hook_name}: {err}; {_fix(plugin)}")


def _returned(plugin: str, hook_name: str, value: Any, wanted: str) -> PluginError:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return PluginError(
        f"plugin {plugin!r} returned {type(value).__name__} {text} from {hook_name}; it must return "
        f"{wanted}: {_fix(plugin)}"
    )


def _block_ids_changed(plugin: str, job: PushJob, spec: ReadSpec) -> str:
    swapped = (spec.local_block_ids, spec.remote_block_ids) == (job.remote_block_ids, job.local_block_ids)
    what = "swaps P's and D's block ids" if swapped else "changes the block ids"
    return (
        f"read-spec plugin {plugin!r} {what} for D rank {spec.dst_tp_rank} (P's "
        f"{_short(spec.local_block_ids)} into D's {_short(spec.remote_block_ids)}, but the request "
        f"pairs P's {_short(job.local_block_ids)} with D's {_short(job.remote_block_ids)}): its "
        f"WRITE would read other blocks of P's and land in blocks D did not name for this "
        f"request. A ReadSpec carries the job's local_block_ids and remote_block_ids unchanged; "
        f"a plugin chooses only the destination rank and the head slices (local_part, remote_part)"
    )


def _short(ids: Any) -> str:
    text = repr(tuple(tuple(group) for group in ids))
    return text if len(text) <= 80 else text[:77] + "..."


def _check_alignment(local: AgentMetadata, peer: AgentMetadata, alignment: RegionAlignment) -> None:
    if len(alignment.remote_indices) != len(local.regions):
        raise HandshakeError(
            f"alignment from {alignment.source!r} pairs {len(alignment.remote_indices)} regions, "
            f"but {local.engine_id!r} {local.rank} has {len(local.regions)}"
        )
    for index in alignment.remote_indices:
        if not 0 <= index < len(peer.regions):
            raise HandshakeError(
                f"alignment from {alignment.source!r} names peer region {index}, but "
                f"{peer.engine_id!r} {peer.rank} has only {len(peer.regions)}"
            )


def _kvpush_version() -> str:
    try:
        return importlib.metadata.version("kvpush")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def get_plugin_manager(
    *,
    load_entrypoints: bool = True,
    plugins: Iterable[tuple[str, object]] = (),
    env: Mapping[str, str] | None = None,
) -> KvpushPluginManager:
    """Build a ready manager.

    In order: add the specs; register the built-in plugins (minus those named in
    ``KVPUSH_DISABLE_PLUGINS``); register ``plugins`` (name, object) pairs given by the caller;
    load the ``kvpush`` entry-point group (only those named in ``KVPUSH_LOAD_PLUGINS`` if it is
    set; an empty value loads none); then ``check_pending()``.
    """
    env = os.environ if env is None else env
    blocked = _split_env(env.get(DISABLE_ENV)) or []
    allow = _split_env(env.get(LOAD_ENV))
    manager = KvpushPluginManager()
    for name in blocked:
        manager.pm.set_blocked(name)
    for name, module_name in BUILTIN_PLUGINS.items():
        if name in blocked:
            continue
        manager.register(importlib.import_module(module_name), name)
    for name, plugin in plugins:
        manager.register(plugin, name, ("local", "-"))
    if load_entrypoints:
        manager.load_entrypoints(allow, blocked)
    manager.check_pending()
    return manager
