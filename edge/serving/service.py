"""The service's lifecycle: load, warm up, tell systemd, watch the engine, shut down.

* The socket is listening before the model loads: loading, scheduler start and a
  warm-up generation run on a background thread; then ``READY=1`` goes to systemd.
* ``WATCHDOG=1`` is sent while loading (systemd's ``TimeoutStartSec`` guards the
  start) and, once serving, only while the engine loop is alive and beating.
* SIGTERM: refuse new work, let streams finish for ``shutdown_grace_s``, cancel the
  rest, stop the scheduler.

Nothing here knows HTTP: the API layer (edge/serving/) reads ``state``, ``engine``,
``scheduler`` and ``active`` and turns them into answers. torch is imported by the
loading thread, not at import.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from edge.monitor import Monitor, MonitorConfig
from edge.serving.sd_notify import Notifier, Watchdog
from edge.serving.metrics import ServiceMetrics
from edge.settings import Settings, read_api_key

if TYPE_CHECKING:
    from edge.runtime.engine import Engine
    from edge.structured.compiler import GrammarCompiler

log = logging.getLogger("edge.serving.service")

LOADING_STATES = ("starting", "loading", "warming")


class Service:
    """State shared by the endpoints: settings, engine, scheduler, monitor, metrics."""

    def __init__(self, settings: Settings, environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)
        self.api_key = read_api_key(settings.api_key_file) if settings.api_key_file else None
        self.model_id = settings.model_name or (Path(settings.model).name if settings.model else "edge-default")
        self.registry = CollectorRegistry()
        self.metrics = ServiceMetrics(self.registry, self._stats_or_none, lambda: self.state == "ready")
        self.monitor_config = MonitorConfig.from_env(self.environ)
        self.monitor: Monitor | None = None
        self.platform: dict[str, Any] | None = None
        self.engine: Engine | None = None
        self.scheduler: Any = None
        self.grammars: GrammarCompiler | None = None  # structured output (edge/structured)
        self.state = "starting"  # starting, loading, warming, ready, failed, stopping
        self.error: str | None = None
        self.exit_code = 0
        self.started_at = time.monotonic()
        self.active: dict[str, Any] = {}  # request id -> RequestHandle
        self.notifier = Notifier(self.environ)
        interval = self.notifier.watchdog_interval_s
        # A heartbeat older than this means the engine loop is stuck: stop the pings
        # (WatchdogSec=30: stale after 15 s, restarted by systemd within 45 s of the hang).
        self.heartbeat_stale_s = max(5.0, interval) if interval else 5.0
        self.watchdog = Watchdog(self.notifier, self.healthy, self.status_line)
        self._lock = threading.RLock()  # RLock: begin_shutdown may run in a signal handler
        self._loader: threading.Thread | None = None
        self.stopping = False
        self._stopped = False
        self.request_exit = lambda code: None  # set by the server that runs us

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the monitor, the watchdog and the background loader (non-blocking)."""
        try:
            self.monitor = Monitor(self.monitor_config, registry=self.registry).start()
        except Exception as exc:  # monitoring is informative, never fatal
            log.warning("monitor unavailable: %s", exc)
        self.watchdog.start()
        self._loader = threading.Thread(target=self._load, name="edge-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        s = self.settings
        try:
            self._set_state("loading")
            log.info("loading model %s", s.model or "(embedded default)")
            from edge.runtime.engine import DEFAULT_MAX_SEQ_LEN, Engine, default_device
            from edge.runtime.threads import apply_threads
            from edge.scheduling import Scheduler

            threads = apply_threads(torch_device_type(s.device, default_device), s.torch_threads)
            log.info("torch CPU threads: %d", threads)
            options: dict[str, Any] = {}
            if s.kv_blocks:
                options["kv_blocks"] = s.kv_blocks
            if s.kv_memory:
                options["kv_memory"] = s.kv_memory
            if s.memory_reserve is not None:
                options["memory_reserve"] = s.memory_reserve
            draft = None
            if s.draft_model is not None:
                # Loaded first, so that the model's KV pool is sized from the memory left
                # beside the draft's weights and its own small paged pool (proposals for
                # two slots never need much).
                seq_len = s.max_seq_len or DEFAULT_MAX_SEQ_LEN
                draft = Engine.from_pretrained(
                    s.draft_model, device=s.device, dtype=s.dtype, kernels=s.kernels, kv_cache="paged",
                    page_size=s.page_size, max_seq_len=seq_len, kv_blocks=2 * -(-seq_len // s.page_size) + 2,
                    cuda_graph=s.cuda_graph,
                )
                # The draft decodes its proposals through its own graphs, one per slot.
                log.info("captured %d draft decode graphs", draft.capture_graphs())
            engine = Engine.from_pretrained(
                s.model,
                device=s.device,
                dtype=s.dtype,
                kernels=s.kernels,
                kv_cache="paged",
                page_size=s.page_size,
                max_seq_len=s.max_seq_len,
                cuda_graph=s.cuda_graph,
                check_weights=not s.skip_weight_check,
                kv_dtype=s.kv_dtype,
                quantize=s.quantize,
                quant_lm_head=s.quant_lm_head,
                quant_embedding=s.quant_embedding,
                on_status=self.notifier.status,  # first-start kernel compile progress in systemd's STATUS
                **options,
            )
            self.engine = engine
            if engine.tokenizer is not None:
                from edge.structured.compiler import GrammarCompiler

                # Builds the grammar engine's token trie in its own thread from now on.
                self.grammars = GrammarCompiler(engine.tokenizer.to_json(), engine.cfg.vocab_size,
                                                engine.tokenizer.eos_token_ids, time_limit_s=s.grammar_time_limit_s)
            from edge.runtime.platform_info import probe_platform

            self.platform = probe_platform().as_dict()  # versions and SMs, probed once
            self._set_state("warming")
            # Every decode graph both slots can need (and the verify graphs when speculation
            # is configured), before serving: no request pays a capture.
            spec_k = s.speculative.num_tokens if s.speculative is not None else None
            log.info("captured %d decode graphs", engine.capture_graphs(speculative_tokens=spec_k))
            mon = self.monitor
            governor = _WarmupExempt(mon.governor) if mon else None
            sched = Scheduler(
                engine,
                queue_size=s.queue_size,
                prefill_chunk=s.prefill_chunk,
                prefill_budget_ms=s.prefill_budget_ms,
                prefix_cache=s.prefix_cache,
                governor=governor,
                energy=mon.energy if mon else None,
                speculative=s.speculative,
                draft=draft,
            )
            with self._lock:
                if self.stopping:
                    return
                sched.start()
                self.scheduler = sched
            t = time.perf_counter()
            # A device that boots hot still warms up (four tokens), then refuses work.
            if governor is not None:
                governor.exempt = True
            try:
                self._warm_up(engine, sched)
            finally:
                if governor is not None:
                    governor.exempt = False
            log.info("warm-up generation took %.0f ms", (time.perf_counter() - t) * 1e3)
            # What loading made lives as long as the process: frozen, the collector never walks
            # it again (a full collection over it holds every thread, the token loop's too).
            gc.collect()
            gc.freeze()
            log.info("%d objects from loading frozen out of garbage collection", gc.get_freeze_count())
            with self._lock:
                if self.stopping:
                    return
                self.state = "ready"
            info = engine.info()
            log.info("ready: %s (%s, %s, context %d) in %.1f s", self.model_id, info["device"], info["dtype"],
                     engine.max_seq_len, time.monotonic() - self.started_at)
            self.notifier.ready(f"ready: {self.model_id} on {info['device']}")
        except Exception as exc:
            if isinstance(exc, self._model_errors()):
                log.error("model load failed: %s", exc)  # the message says it all: no traceback
            else:
                log.exception("model load failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            self.notifier.status(f"failed: {self.error}"[:200])
            from edge.runtime.memory_plan import EXIT_DOES_NOT_FIT, DoesNotFit

            # A model that cannot fit will not fit on a restart either (the unit's RestartPreventExitStatus=).
            self.exit_code = EXIT_DOES_NOT_FIT if isinstance(exc, DoesNotFit) else 1
            self.request_exit(self.exit_code)

    @staticmethod
    def _model_errors() -> tuple[type[Exception], ...]:
        """Errors that describe a broken model directory (or a model too large here), not a bug."""
        from edge.runtime.budget import BudgetError
        from edge.model.tokenizer import TokenizerError
        from edge.model.validate import CheckpointError, ConfigError, NotAModelDirectory

        return ConfigError, CheckpointError, NotAModelDirectory, TokenizerError, BudgetError, FileNotFoundError

    def _warm_up(self, engine: Engine, sched: Any) -> None:
        """One short generation through the scheduler: compiles kernels, captures CUDA
        graphs and renders the chat template before the first real request; the
        tokenizer's longest token (the prompt length bound) is measured here too."""
        from edge.errors import ChatTemplateError, InvalidPrompt
        from edge.sampling import SamplingParams

        if engine.tokenizer is not None:
            log.debug("longest token: %d characters", engine.tokenizer.chars_per_token)
        ids = [1, 2, 3, 4]
        if engine.tokenizer is not None and engine.tokenizer.chat_template:
            try:
                ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
            except (InvalidPrompt, ChatTemplateError) as exc:  # the requests that meet it get a 400
                log.warning("warming up with token ids: %s", exc)
        handle = sched.submit(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              request_id=f"warmup-{uuid.uuid4().hex[:8]}")
        final = None
        for chunk in handle:
            final = chunk
        if final is None or final.finish_reason not in ("stop", "length"):
            reason = None if final is None else (final.message or final.finish_reason)
            raise RuntimeError(f"warm-up generation failed: {reason}")

    def _set_state(self, state: str) -> None:
        self.state = state
        self.notifier.status(self.status_line() or state)

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new work, tell systemd, cancel what is left after the grace."""
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
        n = len(self.active)
        log.info("shutting down: %d request(s) in flight, %.1f s grace", n, self.settings.shutdown_grace_s)
        self.notifier.stopping(f"stopping: {n} request(s) in flight")
        if n:
            timer = threading.Timer(self.settings.shutdown_grace_s, self.cancel_all, kwargs={"why": "grace expired"})
            timer.daemon = True
            timer.start()

    def cancel_all(self, why: str = "shutdown") -> None:
        handles = list(self.active.values())
        if handles:
            log.info("cancelling %d request(s): %s", len(handles), why)
        for h in handles:
            with contextlib.suppress(Exception):
                h.cancel()

    def shutdown(self) -> None:
        """Connections drained or timed out: stop everything. Blocking."""
        self.begin_shutdown()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.state = "stopping" if self.state != "failed" else self.state
        self.cancel_all()
        if self.scheduler is not None:
            try:
                self.scheduler.stop(timeout=5.0)
            except Exception:
                log.exception("scheduler stop failed")
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.monitor.stop()
        if self.grammars is not None:
            self.grammars.close()
        self.watchdog.stop()
        self.notifier.close()
        gc.unfreeze()  # the model goes back to the collector (another may load in this process)
        log.info("stopped")

    def cancel(self, rid: str) -> bool:
        """Barge-in: end request ``rid``; False if it is not in flight."""
        handle = self.active.get(rid)
        done = False
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.cancel()
                done = True
        if self.scheduler is not None:
            with contextlib.suppress(Exception):
                done = bool(self.scheduler.cancel(rid)) or done
        return done

    # -- health -------------------------------------------------------------------------

    def _stats_or_none(self) -> dict[str, Any] | None:
        return self.scheduler.stats() if self.scheduler is not None else None

    def engine_alive(self) -> tuple[bool, str]:
        stats = self._stats_or_none()
        if stats is None:
            return False, "no scheduler"
        if not stats.get("alive"):
            return False, "engine loop is not running"
        hb = stats.get("last_heartbeat")
        if hb is not None and time.monotonic() - float(hb) > self.heartbeat_stale_s:
            return False, f"engine loop heartbeat is {time.monotonic() - float(hb):.1f} s old"
        return True, "ok"

    def healthy(self) -> bool:
        """Watchdog predicate. While loading it holds: systemd enforces WatchdogSec only
        after READY=1 and TimeoutStartSec guards the start. Then: the engine loop beats."""
        if self.state in LOADING_STATES:
            return True
        if self.state == "failed":
            return False
        if self.state == "stopping":
            return True
        return self.engine_alive()[0]

    def status_line(self) -> str | None:
        if self.state == "loading":
            return f"loading {self.model_id}"
        if self.state == "warming":
            return "warming up"
        if self.state == "ready":
            stats = self._stats_or_none() or {}
            n = len(self.active)
            return f"ready: serving {n} request{'s' if n != 1 else ''}, queue {stats.get('queue_depth', 0)}"
        if self.state == "failed":
            return f"failed: {self.error}"[:200]
        return self.state

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(serving, body) for /health: serving is True only when ready and the engine beats."""
        body: dict[str, Any] = {
            "status": self.state,
            "model": self.model_id,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        ok = False
        if self.stopping:
            body["status"] = "stopping"
        elif self.state == "ready":
            ok, why = self.engine_alive()
            body["status"] = "ok" if ok else "unhealthy"
            if not ok:
                body["error"] = why
        elif self.state == "failed":
            body["error"] = self.error
        if self.engine is not None:
            body["engine"] = self.engine.info()
        if self.platform is not None:
            body["platform"] = self.platform
        stats = None
        with contextlib.suppress(Exception):
            stats = self._stats_or_none()
        if stats is not None:
            stats = dict(stats)
            hb = stats.pop("last_heartbeat", None)
            if hb is not None:
                stats["heartbeat_age_s"] = round(time.monotonic() - float(hb), 3)
            stats["active_requests"] = len(self.active)
            body["scheduler"] = stats
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                body["monitor"] = self.monitor.describe()
        return ok, body


class _WarmupExempt:
    """The thermal governor as the scheduler sees it, with admission waived while
    ``exempt`` (the warm-up request must not fail the start of a hot device)."""

    def __init__(self, governor: Any) -> None:
        self._governor = governor
        self.exempt = False

    def check_admission(self) -> None:
        if not self.exempt:
            self._governor.check_admission()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._governor, name)


def torch_device_type(device: str | None, default: Any) -> str:
    """"cpu" or "cuda": where the engine of ``device`` (None: ``default()``'s) computes."""
    return str(device).split(":")[0] if device is not None else default().type
