"""A seeded run's seeding pass, beside its runner (``service.control.runner``): whether
the run's seed set stays in its server's KV cache through the measured requests
(``SeededPass.problem``), the unmeasured pass that prefills every prompt once
(``SeededPass.seed``), and afterwards the proof, from the server's prefix-cache counters,
that every measured request decoded on that KV (``SeededPass.replay_problem``). The
arithmetic is ``service.analysis.seeding``'s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from service.analysis import seeding
from service.analysis.checks import Point
from service.analysis.server_metrics import Scraper
from service.control.fleet import Fleet
from service.control.handles import WorkerHandle
from service.control.vllm_cli import cache_config
from service.control.watchdog import Watchdog
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.load.plan import make_plan
from service.settings import Settings


class SeededPass:
    """The seeding of one seeded run: its seed set's fit, then what the pass took."""

    def __init__(self, settings: Settings, fleet: Fleet, run_id: str, spec: RunSpec) -> None:
        self.settings = settings
        self.fleet = fleet
        self.run_id = run_id
        self.spec = spec
        # The seed set against the server's KV cache (``problem``), and the pass (``seed``).
        self.fit: seeding.Fit | None = None
        self.record: dict[str, Any] | None = None

    async def problem(self, handle: WorkerHandle) -> str | None:
        """Why the run's seed set cannot stay in its server's KV cache through the
        measured requests (``seeding.Fit``), or why it cannot be seeded at all."""
        info = await cache_config(self.fleet.client, handle.url)
        if info.get("enable_prefix_caching") == "False":
            return ("mode \"seeded\" needs vLLM's prefix cache, and this server runs without it "
                    "(enable_prefix_caching False)")
        try:
            block, blocks = int(info["block_size"]), int(info["num_gpu_blocks"])
        except (KeyError, ValueError):
            return ("mode \"seeded\" needs the server's block size and KV cache size "
                    "(vllm:cache_config_info on its /metrics), and it did not give them")
        plan = make_plan(self.spec.model_copy(update={"num_prompts": self.spec.prompt_budget()}),
                         handle.vocab_size)
        lens = [int(n) for n in plan.input_lens]
        if max(lens) <= block:
            return (f"mode \"seeded\" replays whole {block}-token blocks of each prompt from the "
                    f"prefix cache, and no prompt of this run is longer than one block: raise input_len")
        self.fit = seeding.fit(handle.kv_tokens or blocks * block, block, lens,
                               [int(n) for n in plan.output_lens])
        return self.fit.problem()

    async def seed(self, handle: WorkerHandle, watching: Callable[[Watchdog], None]) -> str | None:
        """The seeding pass: every prompt of the run once, one output token each, not
        measured; what it took and whether the seed set was already cached (the server's
        prefix-cache counters around it) kept in ``record``. None once seeded, else why the
        prompts were not; a server that dies or hangs raises the watchdog's finding, and
        ``watching`` is handed the watchdog while it watches."""
        assert self.fit is not None
        spec = self.spec.seeding_spec()
        scraper = Scraper(self.fleet.client, handle.url)
        before = await scraper.scrape()
        drivers = self.fleet.drivers_for(self.run_id, spec, handle, phase="seeding")
        # Watched as the measured requests are: a server that dies or hangs while it
        # prefills the seed set fails the run then, not at the request timeout.
        watch = Watchdog(self.settings, spec, self.fleet, handle, drivers, seeding=True)
        watching(watch)
        samples: list[Sample] = []

        def on_sample(sample: Sample) -> None:
            samples.append(sample)
            watch.saw(sample)

        began = time.perf_counter()
        sending = asyncio.create_task(drivers.run(on_sample))
        watched = asyncio.create_task(watch.run())
        try:
            await asyncio.wait({sending, watched}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                raise watched.result()
            sending.result()
        finally:
            for task in (sending, watched):
                task.cancel()
            await asyncio.gather(sending, watched, return_exceptions=True)
        seconds = time.perf_counter() - began
        if watch.finding is not None:
            raise watch.finding
        after = await scraper.scrape()
        failed = [s for s in samples if not s.success]
        if failed or len(samples) < spec.num_prompts:
            first = next((s.error for s in failed if s.error), "no answer")
            return (f"seeding failed: {len(failed)} of {spec.num_prompts} prompts were not "
                    f"prefilled (first error: {first})")
        lens = [s.prompt_len for s in sorted(samples, key=lambda s: s.index)]
        self.record = seeding.seeding_record(
            seconds, self.fit.block, lens,
            seeding.counters(before.values if before else None, after.values if after else None),
            self.spec.seed_set_salt() or "")
        return None

    @property
    def prompts(self) -> int:
        """The prompts the seeding pass sent (0 before it ran)."""
        return int(self.record["prompts"]) if self.record is not None else 0

    def replay_problem(self, summary: dict[str, Any], vocab_size: int | None,
                       samples: Sequence[Sample], points: Sequence[Point]) -> str | None:
        """The proof that every measured request decoded on the seed set's KV
        (``seeding.replay_problem``), from the server's ``points`` over the run, kept in the
        summary's ``seeding`` with the seeding pass; the reason the run fails when it does
        not hold."""
        assert self.record is not None and self.fit is not None
        warmups = make_plan(self.spec, vocab_size).input_lens
        lengths = [int(n) for n in warmups[:self.spec.warmup_prompts]] + [s.prompt_len for s in samples]
        first, last = seeding.replay_point(points)
        problem, figures = seeding.replay_problem(seeding.counters(first, last), self.fit.block,
                                                  lengths, self.fit)
        summary["seeding"] = {**self.record, "kv_cache_tokens": self.fit.kv_tokens,
                              "seed_set_tokens": self.fit.seed_set, "fresh_tokens": self.fit.fresh,
                              "measured": figures, "proven": problem is None}
        return problem
