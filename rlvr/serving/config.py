"""Typed configuration of `rlvr serve` (YAML plus `--set a.b=c`), validated before anything starts.

Separate from the training `Config`: a served deployment names a checkpoint, its calibration, the
CSA streams and the HTTP front; every unknown key or bad value fails at load, naming the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, model_validator

from rlvr.config import (
    ConfigError,
    LoraConfig,
    Section,
    apply_overrides,
    format_validation_error,
    read_yaml_sections,
    vllm_on_cpu,
)
from rlvr.serving.access import (
    API_KEYS_ENV,
    OPERATOR_KEY_ENV,
    OPERATOR_KEY_FILE,
    allowed_host,
    check_key,
)
from rlvr.serving.stream_host import STREAM_NAME, StreamSpec


class ServeModelConfig(Section):
    path: str = Field(
        "tiny",
        description="Checkpoint to serve: 'tiny', 'tiny-llama', 'smollm2' or a local HF directory "
        "(e.g. runs/NAME/final).",
    )
    adapter: str | None = Field(
        None, description="PEFT adapter directory merged into `path` at start (None: none)."
    )
    seed: int = Field(0, description="Seed for building the tiny model.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights dtype.")
    served_name: str | None = Field(
        None, min_length=1, description="Model id in /v1/models (default: the checkpoint's name)."
    )


class ServeGenerationConfig(Section):
    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="Generation engine; 'hf' is the transformers fallback."
    )
    max_model_len: int = Field(1024, gt=0, description="Prompt + response context per request.")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache size for vLLM on CPU.")
    enforce_eager: bool = Field(False, description="Skip vLLM's torch.compile.")
    torch_threads: int = Field(1, gt=0, description="Torch threads per replica.")


class StreamConfig(Section):
    name: str = Field(
        "default", description="Stream name (requests pick it by metadata.csa_stream)."
    )
    alpha: float = Field(..., gt=0.0, lt=1.0, description="Risk budget on released answers.")
    delta: float = Field(0.1, gt=0.0, lt=1.0, description="Failure probability of the guarantee.")
    m: int = Field(15, ge=2, description="Thresholds in the grid.")
    spacing: Literal["geometric", "linear"] = Field("geometric", description="Grid spacing.")
    epoch_length: int | None = Field(
        None, gt=0, description="CSA-Epoch: reset every N rounds (None: one epoch)."
    )
    label_timeout_s: float | None = Field(
        600.0, gt=0.0, description="A label missing this long counts as a failure (None: never)."
    )
    drift_budget: float = Field(
        0.0,
        ge=0.0,
        description="Drift budget nu (CSA Thm 5.1; our reading of its undefined drift-adjusted "
        "e-process): the e-processes test the budget "
        "alpha + nu and the realised risk is bounded by alpha + nu + slack(N), so nu > 0 "
        "certifies sooner at a looser guarantee. 0 (the paper's choice in every live cell) is "
        "the exact CSA test; must keep alpha + nu < 1.",
    )
    brier_reset: bool = Field(
        False,
        description="Brier early-reset diagnostic (CSA App. B.5): start a new epoch when the "
        "calibrated score's Brier over the last brier_window labels stays above (1 + "
        "brier_threshold) x the epoch's warm-up baseline (its first brier_window labels) for "
        "brier_window consecutive labels.",
    )
    brier_window: int = Field(
        500,
        gt=0,
        description="Labels in the Brier warm-up, in the sliding window, and in the run of "
        "consecutive rises that fires (so no alarm before 2 x brier_window labels of an epoch).",
    )
    brier_threshold: float = Field(
        0.2, gt=0.0, description="Relative Brier rise over the warm-up baseline (0.2: +20%)."
    )

    @model_validator(mode="after")
    def _check(self) -> StreamConfig:
        if not STREAM_NAME.fullmatch(self.name):
            raise ValueError(f"name must match {STREAM_NAME.pattern}")
        if self.alpha + self.drift_budget >= 1.0:
            raise ValueError(
                f"alpha + drift_budget must stay below 1, got {self.alpha} + {self.drift_budget}"
            )
        return self

    def stream_spec(self, grid: Sequence[float]) -> StreamSpec:
        """The durable stream's spec for this entry on `grid` (computed from the calibration)."""
        return StreamSpec(
            alpha=self.alpha,
            delta=self.delta,
            grid=tuple(float(q) for q in grid),
            epoch_length=self.epoch_length,
            label_timeout_s=self.label_timeout_s,
            drift_budget=self.drift_budget,
            # Off, the diagnostic's settings stay out of the spec: editing them starts no epoch.
            **(
                {"brier_window": self.brier_window, "brier_threshold": self.brier_threshold}
                if self.brier_reset
                else {}
            ),
        )


class ServeCSAConfig(Section):
    calibration: str | None = Field(
        None,
        description="Calibration artefact (default: csa_calibration.json in the checkpoint, or "
        "in the adapter directory when one is set).",
    )
    streams: list[StreamConfig] = Field(
        default_factory=lambda: [StreamConfig(alpha=0.2)],
        min_length=1,
        description="Served streams; the first is the default.",
    )
    state_dir: str | None = Field(
        None, description="Durable stream state (default: runs/<name>/csa)."
    )
    fallback: str = Field(
        "I am not confident enough in this answer to give it.",
        description="Content returned when the gate abstains.",
    )

    @model_validator(mode="after")
    def _check(self) -> ServeCSAConfig:
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must be unique, got {names}")
        return self


class ServeHTTPConfig(Section):
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    port: int = Field(8000, gt=0, lt=65536, description="HTTP port.")
    max_body_bytes: int = Field(
        65536, gt=0, description="Largest request body accepted (larger: 413)."
    )
    request_timeout_s: float = Field(120.0, gt=0.0, description="End-to-end request timeout.")
    api_keys: list[Annotated[str, AfterValidator(check_key)]] = Field(
        default_factory=list,
        description="Client API keys (`Authorization: Bearer KEY`) for the OpenAI endpoints; "
        f"also read from api_keys_file and ${API_KEYS_ENV} (comma-separated). None anywhere: "
        "those endpoints are open.",
    )
    api_keys_file: str | None = Field(
        None, description="File of client API keys, one per line (# comments allowed)."
    )
    operator_key_file: str | None = Field(
        None,
        description="File holding the operator key, which alone opens /v1/feedback and "
        f"/v1/csa/status (${OPERATOR_KEY_ENV} overrides it; neither: a key is generated once "
        f"into the state directory's {OPERATOR_KEY_FILE}).",
    )
    allowed_hosts: list[Annotated[str, AfterValidator(allowed_host)]] | None = Field(
        None,
        description="Host header names answered (others: 403; a Host header that is not a "
        "name or address with an optional port: 400). None: the loopback names when bound to "
        "loopback, any otherwise; []: any.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Bind an address beyond loopback with the OpenAI endpoints open (no client "
        "API keys); refused otherwise.",
    )
    open_health_check: bool = Field(
        False,
        description="Answer GET /-/healthz without a key or Host check, for a load balancer "
        "whose probes cannot send one (it tells only whether the proxy takes traffic: 200 "
        "`success`, else 503). Otherwise it asks what the OpenAI endpoints ask.",
    )


class ReplicasConfig(Section):
    num_replicas: int = Field(1, gt=0, description="Serve replicas (each loads the model).")
    cpus: float = Field(1.0, ge=0.0, description="CPUs reserved per replica.")
    max_ongoing_requests: int = Field(
        8,
        gt=0,
        description="Completion requests a replica holds at once (one generating, the rest "
        "waiting); more get 429 with Retry-After.",
    )


class ServeVerifierConfig(Section):
    enabled: bool = Field(
        True, description="Shadow-verify requests that carry metadata.reference (math verifier)."
    )
    num_actors: int = Field(1, gt=0, description="VerifierActors per replica.")
    timeout_s: float = Field(5.0, gt=0.0, description="Hard per-item verification timeout.")


def _live_lora() -> LoraConfig:
    """The paper's live-cell adapter (arXiv:2605.20270 Sec. 6.2): r 16, alpha 32, q/k/v/o."""
    return LoraConfig(
        enabled=True, r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )


class ServeLiveConfig(Section):
    enabled: bool = Field(
        False,
        description="Live learning (CSA Sec. 6.2): every round_size requests of `stream`, a LoRA "
        "update trained on that round's verifier-correct answers (Expert Iteration) is published "
        "and the replicas switch to it at a seq boundary (rules R1-R2).",
    )
    stream: str | None = Field(
        None, description="Stream whose verified rounds train the model (None: the first)."
    )
    round_size: int = Field(100, gt=0, description="Requests per Expert-Iteration round.")
    algorithm: Literal["sft", "grpo"] = Field(
        "sft",
        description="'sft': Expert Iteration, SFT on the round's verifier-correct answers (the "
        "paper's); 'grpo': GRPO on the round's shadow-verified prompts (group_size fresh samples "
        "each from the current version, rewarded by the verifier against their reference).",
    )
    group_size: int = Field(8, gt=1, description="GRPO: samples per prompt.")
    temperature: float = Field(1.0, gt=0.0, description="GRPO: sampling temperature.")
    max_tokens: int = Field(256, gt=0, description="GRPO: tokens per sample at most.")
    epochs: int = Field(2, gt=0, description="Passes over a round's data per update.")
    batch_size: int = Field(4, gt=0, description="Pairs (GRPO: prompts) per optimizer step.")
    lr: float = Field(1e-5, gt=0.0, description="Adam learning rate of the LoRA update.")
    lora: LoraConfig = Field(default_factory=_live_lora, description="The trained adapter.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage of the updater.")
    threads: int = Field(1, gt=0, description="Torch threads of the updater's policy rank.")
    cpus: float = Field(1.0, ge=0.0, description="CPUs reserved for the updater's policy rank.")
    poll_s: float = Field(
        5.0,
        gt=0.0,
        description="Seconds between the updater's looks for closed rounds, and between a "
        "replica's looks for a published version.",
    )
    seed: int = Field(0, description="Seed of the adapter's init and of each round's shuffles.")
    dir: str | None = Field(
        None, description="Published adapters and the updater's state (default: runs/<name>/live)."
    )

    @model_validator(mode="after")
    def _check(self) -> ServeLiveConfig:
        if self.enabled and not self.lora.enabled:
            raise ValueError("lora.enabled: live updates train a LoRA adapter; it must be true")
        return self


class ServeConfig(Section):
    """A deployment's configuration (`rlvr serve`): its model, sampling, CSA streams, replicas
    and HTTP front, validated as a whole when built or changed."""

    name: str = Field("serve", min_length=1, description="Deployment name (actor and state).")
    model: ServeModelConfig = Field(default_factory=ServeModelConfig)
    generation: ServeGenerationConfig = Field(default_factory=ServeGenerationConfig)
    csa: ServeCSAConfig = Field(default_factory=ServeCSAConfig)
    http: ServeHTTPConfig = Field(default_factory=ServeHTTPConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    verifier: ServeVerifierConfig = Field(default_factory=ServeVerifierConfig)
    live: ServeLiveConfig = Field(default_factory=ServeLiveConfig)

    @model_validator(mode="after")
    def _check_live(self) -> ServeConfig:
        names = [s.name for s in self.csa.streams]
        if self.live.stream is not None and self.live.stream not in names:
            raise ValueError(f"live.stream: {self.live.stream!r} is not one of the streams {names}")
        return self

    def state_dir(self) -> Path:
        """Where the StreamsActor keeps the durable streams."""
        return Path(self.csa.state_dir or Path("runs") / self.name / "csa")

    def live_dir(self) -> Path:
        """Where the live updater keeps its adapters and progress."""
        return Path(self.live.dir or Path("runs") / self.name / "live")

    def live_stream(self) -> str:
        """The stream whose verified rounds train the live updates."""
        return self.live.stream or self.csa.streams[0].name

    def vllm_on_cpu(self) -> bool:
        """Whether generation runs on vLLM's CPU backend (replicas hold no GPUs)."""
        return vllm_on_cpu(self.generation.backend)

    def check_cpus(self, available: float) -> None:
        """Fail before anything starts when the replicas ask for more CPUs than there are."""
        need = self.replicas.num_replicas * self.replicas.cpus
        if need > available + 1e-9:
            raise ConfigError(
                f"invalid serve config: replicas: {need:g} CPUs requested but {available:g} "
                "are available; lower replicas.num_replicas or replicas.cpus"
            )

    def check_cluster(self, nodes: list[dict[str, float]]) -> None:
        """`check_cpus` against the CPUs of the cluster's live nodes (what `init_ray` asks of
        every config before it starts anything)."""
        self.check_cpus(sum(float(n.get("CPU", 0.0)) for n in nodes))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def load_serve_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> ServeConfig:
    """Load a serve YAML (or the defaults), apply `a.b=c` overrides, validate naming bad keys."""
    data = apply_overrides(
        read_yaml_sections(path, kind="serve config"),
        overrides or [],
        kind="serve config",
    )
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err).replace("invalid config", "invalid serve config")
        ) from None
