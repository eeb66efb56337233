"""The connector and the CLI against vLLM 0.33, read from its published wheel (never imported),
and against the installed 0.32: hooks and their signatures, the scheduler output the connector
reads, ``vllm bench serve``'s flags. The checker is shown to fail on a signature changed on purpose.

The wheel is fetched from the package index by ``make setup-dev`` into ``.cache/vllm-wheels``;
run without it, the first test here fetches it (and fails saying so when it cannot)."""

from __future__ import annotations

import argparse
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from service.cli import vllm_flags
from service.cli.commands import bench_serve
from tests import vllm_source as vs
from tests.lazy import Lazy

h = Lazy("tests.vllm_harness")

VERSION = vs.NEXT
BEFORE = "0.32.0"


@pytest.fixture(scope="module")
def wheel() -> vs.Wheel:
    """vLLM 0.33's sources (the cached wheel, fetched first if missing)."""
    return vs.Wheel(vs.fetch(VERSION))


def _ours() -> dict[str, str]:
    return {module: vs.ours(module) for module in vs.OUR_MODULES}


def _patched(sources: Callable[[str], str], module: str, old: str, new: str) -> vs.Sources:
    """``sources`` with ``old`` replaced in ``module`` (which must hold it)."""
    text = sources(module)
    assert old in text, f"{module} no longer holds {old!r}: change the test's edit"
    changed = text.replace(old, new)
    return lambda name: changed if name == module else sources(name)


def _problems(our: Mapping[str, str], theirs: vs.Sources) -> list[str]:
    return vs.connector_problems(our, theirs, VERSION, vs.installed, BEFORE)


def test_the_wheel_read_is_vllm_033(wheel: vs.Wheel) -> None:
    with zipfile.ZipFile(wheel.path) as z:
        metadata = z.read(f"vllm-{VERSION}.dist-info/METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in metadata


# --- the connector's classes -----------------------------------------------------------------------


def test_fill_connector_fits_the_installed_vllm() -> None:
    assert vs.connector_problems(_ours(), vs.installed, BEFORE) == []


def test_fill_connector_fits_vllm_033(wheel: vs.Wheel) -> None:
    # Every abstract method implemented, every hook with 0.33's parameters, every 0.32 hook
    # still a hook, every attribute of vLLM's classes read still set, the constructor skipped
    # (DecodeBenchConnector's) setting nothing ours does not.
    assert _problems(_ours(), wheel) == []


def test_the_checker_sees_every_hook_the_connector_overrides(wheel: vs.Wheel) -> None:
    # What the check above covers: the hooks of the three classes, and 0.33's abstract methods.
    known = vs.gather({**{m: wheel(m) for m in vs.CONNECTOR_MODULES}, **_ours()})
    hooks = {name: sorted(vs.overrides(known[name], vs.mro(name, known)))
             for name in ("FillConnector", "FillConnectorScheduler", "FillConnectorWorker")}
    assert hooks == {
        "FillConnector": ["__init__", "bind_connector_metadata", "requires_kv_delivery", "shutdown",
                          "start_load_kv", "wait_for_save"],
        "FillConnectorScheduler": ["__init__", "build_connector_meta", "get_num_new_matched_tokens",
                                   "request_finished", "update_state_after_alloc"],
        "FillConnectorWorker": ["__init__", "register_kv_caches", "start_fill_kv"],
    }
    base = known["KVConnectorBase_V1"]
    assert {n for n, m in base.methods.items() if m.abstract} >= {
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"}
    # 0.33's constructor takes the KV cache config; handle_preemptions the connector metadata.
    assert base.methods["__init__"].params == ("self", "vllm_config", "role", "kv_cache_config")
    assert base.methods["handle_preemptions"].params == ("self", "kv_connector_metadata")
    assert base.methods["requires_kv_delivery"].kind == "property"


def test_a_hook_parameter_renamed_on_purpose_is_reported(wheel: vs.Wheel) -> None:
    ours = _ours()
    ours["connector.facade"] = _patched(
        vs.ours, "connector.facade", "def start_load_kv(self, forward_context: Any,",
        "def start_load_kv(self, context: Any,")("connector.facade")
    assert _problems(ours, wheel) == [
        f"FillConnector.start_load_kv(self, context, **kwargs) does not match vLLM {VERSION}'s "
        "DecodeBenchConnector.start_load_kv(self, forward_context, **kwargs)",
        f"FillConnector.start_load_kv(self, context, **kwargs) does not match vLLM {VERSION}'s "
        "KVConnectorBase_V1.start_load_kv(self, forward_context, **kwargs)",
    ]


def test_a_property_made_a_method_on_purpose_is_reported(wheel: vs.Wheel) -> None:
    ours = _ours()
    ours["connector.facade"] = _patched(
        vs.ours, "connector.facade", "    @property\n    def requires_kv_delivery",
        "    def requires_kv_delivery")("connector.facade")
    assert _problems(ours, wheel) == [
        f"FillConnector.requires_kv_delivery(self) does not match vLLM {VERSION}'s "
        "KVConnectorBase_V1.@property requires_kv_delivery(self)"]


def test_a_parameter_vllm_adds_to_a_hook_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, vs.BASE, "    def wait_for_save(self):", "    def wait_for_save(self, step):")
    assert _problems(_ours(), theirs) == [
        f"FillConnector.wait_for_save(self) does not match vLLM {VERSION}'s "
        "KVConnectorBase_V1.wait_for_save(self, step)"]


def test_a_new_abstract_method_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, vs.BASE, "    @abstractmethod\n    def wait_for_save(self):",
                      "    @abstractmethod\n    def deliver_kv(self, request) -> None:\n        pass\n\n"
                      "    @abstractmethod\n    def wait_for_save(self):")
    assert _problems(_ours(), theirs) == [
        f"FillConnector does not implement deliver_kv, abstract in vLLM {VERSION}'s KVConnectorBase_V1"]


def test_a_hook_vllm_renames_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, vs.DECODE_BENCH, "def start_fill_kv(", "def fill_kv(")
    assert _problems(_ours(), theirs) == [
        f"FillConnectorWorker.start_fill_kv overrides vLLM {BEFORE}'s DecodeBenchConnectorWorker."
        f"start_fill_kv, which vLLM {VERSION} no longer has"]


def test_an_attribute_vllm_renames_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, vs.DECODE_BENCH, "self._filled_requests", "self._filled")
    assert _problems(_ours(), theirs) == [
        f"FillConnectorScheduler reads self._filled_requests, which no class of vLLM {VERSION} "
        "it builds on sets"]


def test_what_the_skipped_constructor_would_set_is_reported(wheel: vs.Wheel) -> None:
    # FillConnector.__init__ calls KVConnectorBase_V1's, skipping DecodeBenchConnector's.
    where = "        self.connector_scheduler: DecodeBenchConnectorScheduler"
    theirs = _patched(wheel, vs.DECODE_BENCH, where, "        self.fill_stream = None\n" + where)
    assert _problems(_ours(), theirs) == [
        f"FillConnector.__init__ skips vLLM {VERSION}'s DecodeBenchConnector.__init__, which sets "
        "self.fill_stream; FillConnector.__init__ does not"]


def test_the_scheduler_takes_requires_kv_delivery_false(tmp_path: Path) -> None:
    # vLLM (0.32 and 0.33) reads the property once, when its scheduler builds the connector:
    # kv_both defaults it to True, which drops a preempted request's in-flight tokens.
    kv = h.kv_config([(["layer0"], h.attention(16))])
    assert h.scheduler(h.vllm_config(tmp_path, h.OURS), kv).requires_kv_delivery is False
    kv = h.kv_config([(["layer0"], h.attention(16))])
    assert h.scheduler(h.vllm_config(tmp_path, h.UPSTREAM), kv).requires_kv_delivery is True


def test_vllm_033s_scheduler_reads_requires_kv_delivery(wheel: vs.Wheel) -> None:
    assert "self.requires_kv_delivery = self.connector.requires_kv_delivery" in wheel(
        "vllm.v1.core.sched.scheduler")


# --- what the connector reads of vLLM's scheduler output, requests and KV cache config -------------

# connector/steps.py (StepTracker.observe, admitted), connector/scheduler.py, connector/worker.py.
READ = [
    ("vllm.v1.core.sched.output", "SchedulerOutput", "total_num_scheduled_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "num_scheduled_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_spec_decode_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_new_reqs"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_cached_reqs"),
    ("vllm.v1.core.sched.output", "NewRequestData", "req_id"),
    ("vllm.v1.core.sched.output", "NewRequestData", "num_computed_tokens"),
    ("vllm.v1.core.sched.output", "CachedRequestData", "req_ids"),
    ("vllm.v1.core.sched.output", "CachedRequestData", "num_computed_tokens"),
    ("vllm.v1.request", "Request", "request_id"),
    ("vllm.v1.request", "Request", "num_prompt_tokens"),
    ("vllm.v1.request", "Request", "kv_transfer_params"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", "num_blocks"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", "kv_cache_groups"),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "layer_names"),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "kv_cache_spec"),
    ("vllm.v1.kv_cache_interface", "UniformTypeKVCacheSpecs", "kv_cache_specs"),
    ("vllm.v1.kv_cache_interface", "AttentionSpec", "block_size"),
]


@pytest.mark.parametrize("version", [BEFORE, VERSION])
def test_the_fields_the_connector_reads_exist(version: str, wheel: vs.Wheel) -> None:
    sources = vs.installed if version == BEFORE else wheel
    known = {module: vs.classes(sources(module), module) for module in {m for m, _, _ in READ}}
    missing = [f"{cls}.{attribute}" for module, cls, attribute in READ
               if not vs.has_attribute(known[module], cls, attribute)]
    assert missing == []


def test_a_field_vllm_renames_is_missing(wheel: vs.Wheel) -> None:
    module = "vllm.v1.core.sched.output"
    text = wheel(module).replace("total_num_scheduled_tokens:", "num_tokens_scheduled:")
    known = vs.classes(text, module)
    assert not vs.has_attribute(known, "SchedulerOutput", "total_num_scheduled_tokens")
    assert vs.has_attribute(known, "SchedulerOutput", "num_scheduled_tokens")


# --- vllm bench serve's flags --------------------------------------------------------------------------

# Honoured flags whose defaults must be vLLM's (as tests/test_cli.py holds them for the installed one).
SAME_DEFAULTS = ("--num-prompts", "--random-input-len", "--random-output-len", "--burstiness", "--seed",
                 "--num-warmups", "--request-rate", "--metric-percentiles", "--max-concurrency",
                 "--dataset-name", "--backend", "--endpoint")


def _flag_problems(theirs: Mapping[str, object], version: str) -> list[str]:
    """What of ``vllm bench serve``'s flags (flag -> default) the CLI neither honours nor refuses,
    or honours with another default."""
    ours = {flag: param.default for param in bench_serve.params for flag in getattr(param, "opts", [])}
    problems = [f"vLLM {version}'s {flag} is neither honoured nor refused"
                for flag in sorted(set(theirs) - set(ours) - set(vllm_flags.REFUSED))]
    problems += [f"{flag} is both honoured and refused"
                 for flag in sorted(set(ours) & set(vllm_flags.REFUSED))]
    for flag in SAME_DEFAULTS:
        if flag not in theirs:
            problems.append(f"vLLM {version} has no {flag}")
        elif ours[flag] != theirs[flag]:
            problems.append(f"{flag}: decodebench's default {ours[flag]!r}, "
                            f"vLLM {version}'s {theirs[flag]!r}")
    return problems


def test_every_flag_of_vllm_033_bench_serve_is_honoured_or_refused(wheel: vs.Wheel) -> None:
    assert _flag_problems(vs.bench_serve_flags(wheel), VERSION) == []


def test_the_flag_reader_reads_what_argparse_builds() -> None:
    # The installed vLLM's parser, built, against its source read: the same flags and defaults.
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    built = {flag: action.default for action in parser._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    read = vs.bench_serve_flags(vs.installed)
    assert set(read) == set(built)
    unread = {flag for flag, default in read.items() if default is vs.NOT_LITERAL}
    # A random prefix per parser: the one default no reader could know.
    assert unread == {"--request-id-prefix"}
    assert {f: d for f, d in read.items() if f not in unread} == {
        f: built[f] for f in read if f not in unread}


def test_a_flag_vllm_adds_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, "vllm.benchmarks.serve", '    parser.add_argument(\n        "--label",',
                      '    parser.add_argument("--kv-hand-off", action=argparse.BooleanOptionalAction)\n'
                      '    parser.add_argument(\n        "--label",')
    assert _flag_problems(vs.bench_serve_flags(theirs), VERSION) == [
        f"vLLM {VERSION}'s --kv-hand-off is neither honoured nor refused",
        f"vLLM {VERSION}'s --no-kv-hand-off is neither honoured nor refused",
    ]


def test_a_default_vllm_changes_is_reported(wheel: vs.Wheel) -> None:
    theirs = _patched(wheel, "vllm.benchmarks.datasets.datasets", "DEFAULT_NUM_PROMPTS = 1000",
                      "DEFAULT_NUM_PROMPTS = 200")
    assert _flag_problems(vs.bench_serve_flags(theirs), VERSION) == [
        f"--num-prompts: decodebench's default 1000, vLLM {VERSION}'s 200"]
