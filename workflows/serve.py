"""`rlvr serve`: a Ray Serve app with an OpenAI-compatible API behind the CSA release gate.

Per request (one round of Algorithm 1 of arXiv:2605.20270, with the delayed verifier evaluation
of App. B.4): K self-consistency samples, the majority answer, raw score 1 - agreement, calibrated
score g(raw), then the stream's decision from the StreamsActor, the single writer of every
stream (any number of replicas share them). Released: the answer; abstained: the configured
fallback; always a `csa` object. Each round's label source is fixed when it is decided: shadow
verification for requests with metadata.reference (a VerifierActor pool, applied asynchronously),
otherwise POST /v1/feedback with the operator key; a label overdue past the stream's timeout
counts as a failure. Prompts are rendered as the calibration rendered its own, and every sample
uses the calibrated K, temperature, top_p and max_tokens: the score has one definition per epoch.

With `live.enabled`, the driver also runs the live updater (`workflows.live_updater`): every
`live.round_size` closed rounds of the live stream become a LoRA update, published at a seq
boundary. Each replica starts on the newest published version, and a thread of its own looks for
a newer one every `live.poll_s` seconds, merges the adapter into the base weights off the request
path and swaps the engine's weights between two generations, so a request waits at most one
weight swap longer. Every answer names the policy version that generated it, and the stream
records it per round (rule R1); a version trained on labels up to seq k serves only later seqs
(R2, checked by the stream owner).
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from actors.controller import NAMESPACE
from actors.streams import StreamsActor, streams_name
from rlvr.config import ConfigError
from rlvr.models import resolve_model_path
from rlvr.models.checkpoints import checkpoint_fingerprint, with_adapter
from rlvr.models.checks import check_model_dir
from rlvr.serving.access import (
    API_KEYS_ENV,
    AccessPolicy,
    default_allowed_hosts,
    env_keys,
    is_loopback,
    operator_key,
    read_keys,
)
from rlvr.serving.api import (
    CALIBRATION_FILE,
    Calibration,
)
from rlvr.serving.config import ServeConfig
from rlvr.serving.edge import ROUTES_PATH, EdgePolicy
from rlvr.serving.live_updates import UPDATER_FILE, UpdaterState
from rlvr.serving.stream_host import StreamSpec
from workflows.serve_replica import ADMISSION_SLACK, APP_NAME, CSAServer, ServeSettings
from workflows.stopping import stop_event_on_signals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedServe:
    """A validated deployment: replica settings, stream specs and the versions they serve."""

    settings: ServeSettings
    specs: dict[str, StreamSpec]
    policy: str
    scorer: str
    state_dir: Path
    operator_key_source: str


def resolve_access(
    cfg: ServeConfig, environ: dict[str, str] | None = None
) -> tuple[AccessPolicy, str]:
    """The keys and Host names the replicas accept, and where the operator key came from;
    ConfigError naming the key for an unreadable key file or an open non-loopback bind."""
    environ = dict(os.environ if environ is None else environ)
    http = cfg.http
    try:
        client = list(http.api_keys) + env_keys(environ.get(API_KEYS_ENV))
        if http.api_keys_file:
            client += read_keys(http.api_keys_file, "http.api_keys_file")
        op_key, op_source = operator_key(http.operator_key_file, cfg.state_dir(), environ)
    except ValueError as err:
        raise ConfigError(f"invalid serve config: {err}") from None
    if not client and not is_loopback(http.host) and not http.allow_unauthenticated:
        raise ConfigError(
            f"invalid serve config: http.host: {http.host} is reachable beyond this machine and "
            f"no client API keys are set (http.api_keys, http.api_keys_file or ${API_KEYS_ENV}); "
            "set keys, or http.allow_unauthenticated=true to serve it open"
        )
    hosts = default_allowed_hosts(http.host) if http.allowed_hosts is None else http.allowed_hosts
    return AccessPolicy.build(client, [op_key], hosts), op_source


def prepare_serve(cfg: ServeConfig) -> PreparedServe:
    """Everything that can fail on bad input (model, adapter, calibration, grids, keys), before
    Ray."""
    try:
        model_dir = resolve_model_path(cfg.model.path, seed=cfg.model.seed)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid serve config: model.path: {err}") from None
    try:
        model_dir = with_adapter(model_dir, cfg.model.adapter)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid serve config: model.adapter: {err}") from None
    check_model_dir(model_dir, cfg.generation.max_model_len, cfg.vllm_on_cpu())
    cal_path = Path(cfg.csa.calibration or Path(cfg.model.adapter or model_dir) / CALIBRATION_FILE)
    try:
        calibration = Calibration.load(cal_path)
    except ValueError as err:
        raise ConfigError(f"invalid serve config: csa.calibration: {err}") from None
    if calibration.max_tokens >= cfg.generation.max_model_len:
        raise ConfigError(
            f"invalid serve config: generation.max_model_len: {cfg.generation.max_model_len} "
            f"leaves no room for prompts after the calibrated max_tokens={calibration.max_tokens}"
        )
    specs = {}
    for i, s in enumerate(cfg.csa.streams):
        try:
            grid = calibration.grid(s.alpha, s.m, s.spacing)
        except ValueError as err:
            raise ConfigError(f"invalid serve config: csa.streams.{i}.alpha: {err}") from None
        specs[s.name] = s.stream_spec(grid.tolist())
    policy = checkpoint_fingerprint(model_dir)
    if calibration.checkpoint and calibration.checkpoint != policy:
        log.warning(
            "calibration %s was fit on %s, serving %s: the score map is kept (assumption P)",
            cal_path,
            calibration.checkpoint,
            policy,
        )
    # Last: a missing operator key is generated here, once everything else is known good.
    access, operator_key_source = resolve_access(cfg)
    backend_kwargs: dict[str, Any] = {"dtype": cfg.model.dtype}
    if cfg.generation.backend == "vllm":
        backend_kwargs |= {
            "max_model_len": cfg.generation.max_model_len,
            "kv_cache_gib": cfg.generation.kv_cache_gib,
            "enforce_eager": cfg.generation.enforce_eager,
            "cpu_threads": cfg.generation.torch_threads,
        }
    settings = ServeSettings(
        model_dir=str(model_dir),
        served_name=cfg.model.served_name or model_dir.name,
        backend=cfg.generation.backend,
        backend_kwargs=backend_kwargs,
        torch_threads=cfg.generation.torch_threads,
        max_model_len=cfg.generation.max_model_len,
        calibration=calibration.to_dict(alphas=()),
        streams=tuple(specs),
        streams_actor=streams_name(cfg.name),
        fallback=cfg.csa.fallback,
        max_body_bytes=cfg.http.max_body_bytes,
        verifier=cfg.verifier.model_dump() if cfg.verifier.enabled else None,
        access=access,
        max_held_requests=cfg.replicas.max_ongoing_requests,
        policy=policy,
        live_stream=cfg.live_stream() if cfg.live.enabled else None,
        live_dir=str(cfg.live_dir().resolve()) if cfg.live.enabled else None,
        live_poll_s=cfg.live.poll_s,
    )
    return PreparedServe(
        settings, specs, policy, calibration.version, cfg.state_dir(), operator_key_source
    )


def ensure_streams(cfg: ServeConfig, state_dir: Path) -> ray.actor.ActorHandle:
    """The named StreamsActor owning the deployment's streams (restarted by Ray, restoring them
    from disk)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return (
        ray.remote(StreamsActor)
        .options(
            name=streams_name(cfg.name),
            namespace=NAMESPACE,
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
        )
        .remote(str(state_dir.resolve()))
    )


def build_app(cfg: ServeConfig, prepared: PreparedServe, gate: bool = True) -> serve.Application:
    """The Serve application (not started); `gate=False` serves ungated, for benchmarks only."""
    settings = asdict(prepared.settings) | {"gate": gate}
    return CSAServer.options(
        num_replicas=cfg.replicas.num_replicas,
        ray_actor_options={"num_cpus": cfg.replicas.cpus},
        max_ongoing_requests=cfg.replicas.max_ongoing_requests + ADMISSION_SLACK,
    ).bind(settings)


def start_serving(
    cfg: ServeConfig,
    prepared: PreparedServe,
    app_name: str = APP_NAME,
    route_prefix: str = "/",
    gate: bool = True,
) -> ray.actor.ActorHandle:
    """Start Serve on cfg.http, open the streams, run the app; returns the StreamsActor.

    Keep the returned handle: the actor is not detached, so it ends when its handles are gone.
    The proxy starts with the edge (`rlvr.serving.edge`) in front of everything it answers.
    """
    edge = EdgePolicy(prepared.settings.access, open_healthz=cfg.http.open_health_check)
    serve.start(
        http_options={
            "host": cfg.http.host,
            "port": cfg.http.port,
            "request_timeout_s": cfg.http.request_timeout_s,
        },
        # The controller's environment is the one its proxies start with.
        controller_options={"runtime_env": {"env_vars": edge.environment()}},
    )
    check_edge(cfg.http.host, cfg.http.port)
    streams = ensure_streams(cfg, prepared.state_dir)
    # A live deployment restarts on its newest published version, not back on the base weights.
    policy = prepared.policy
    if cfg.live.enabled:
        latest = UpdaterState.load(cfg.live_dir() / UPDATER_FILE).latest
        policy = latest["policy"] if latest is not None else policy
    for name, spec in prepared.specs.items():
        opened = ray.get(streams.open.remote(name, spec.to_dict(), policy, prepared.scorer))
        log.info(
            "stream %s: epoch %d, next seq %d, threshold %s",
            name,
            opened["epoch"],
            opened["next_seq"],
            opened["threshold"],
        )
    serve.run(build_app(cfg, prepared, gate), name=app_name, route_prefix=route_prefix)
    return streams


def check_edge(host: str, port: int) -> None:
    """RuntimeError unless the proxy on host:port refuses its route listing to a caller without a
    key, as the edge does: a Serve instance that was running already keeps its own proxy."""
    address = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no $http_proxy
    try:
        with direct.open(f"http://{netloc}{ROUTES_PATH}", timeout=30) as response:
            status = response.status
    except urllib.error.HTTPError as err:
        status = err.code
    if status not in (401, 403):
        raise RuntimeError(
            f"the Serve proxy on {netloc} answers {ROUTES_PATH} without a key ({status}): a Serve "
            "instance started elsewhere runs in this cluster without rlvr's access checks; shut "
            "it down (`serve shutdown`) first"
        )


def serve_forever(cfg: ServeConfig, prepared: PreparedServe) -> None:
    """`rlvr serve`: run until Ctrl-C or SIGTERM (Ctrl-C also during start-up), then shut Serve
    down (stream state stays on disk)."""
    streams = None
    try:
        # The stream owner lives as long as this driver holds a handle to it.
        streams = start_serving(cfg, prepared)
        announce(cfg, prepared)
        with stop_event_on_signals() as stop:
            if cfg.live.enabled:
                live_updates(cfg, prepared, streams, stop)
            else:
                stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_serving(streams)


def announce(cfg: ServeConfig, prepared: PreparedServe) -> None:
    """Say where the deployment answers, and where its operator key comes from."""
    print(
        f"serving {prepared.settings.served_name} at http://{cfg.http.host}:{cfg.http.port}/v1 "
        f"(streams: {', '.join(prepared.specs)}; state: {prepared.state_dir}; operator key for "
        f"/v1/feedback and /v1/csa/status: {prepared.operator_key_source})",
        flush=True,
    )


def live_updates(
    cfg: ServeConfig, prepared: PreparedServe, streams: ray.actor.ActorHandle, stop: threading.Event
) -> None:
    """Run the live updater (`live.enabled`) until `stop` is set: every closed round of the live
    stream becomes an update; a lost updater is replaced and resumes from its progress on disk."""
    from workflows.live_updater import LiveUpdater

    updater = LiveUpdater(cfg, prepared.settings.model_dir, streams)
    print(
        f"live updates: every {cfg.live.round_size} rounds of stream {cfg.live_stream()} "
        f"(adapters in {cfg.live_dir()})",
        flush=True,
    )
    try:
        while not stop.is_set():
            try:
                records = updater.poll()
            except RayActorError as err:
                # Its progress is on disk: a new updater resumes after the last published round.
                log.warning("live updater lost (%s); restarting it", type(err).__name__)
                updater = LiveUpdater(cfg, prepared.settings.model_dir, streams)
                continue
            for record in records:
                print(
                    f"live round {record['round']}: {record['policy'] or 'no update'}", flush=True
                )
            stop.wait(cfg.live.poll_s)
    finally:
        updater.close()


def stop_serving(streams: ray.actor.ActorHandle | None) -> None:
    """Shut Serve down and end the StreamsActor (its streams' state stays on disk)."""
    serve.shutdown()
    if streams is not None:
        ray.kill(streams, no_restart=True)
