"""The model configuration, read from a checkpoint's config.json.

Field names are those of transformers' GraniteMoeHybridConfig, so a config.json
written for that architecture (dense: num_local_experts = 0) loads unchanged and
ours loads there. Paper symbols of docs/DESIGN.md §1 in the comments.
"""
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba",  # the names either library writes
               "attention": "attention", "full_attention": "attention"}

LIMITS = {  # sizes beyond these are refused before anything is allocated
    "vocab_size": 4_000_000, "hidden_size": 65_536, "num_hidden_layers": 1_024,
    "num_attention_heads": 1_024, "num_key_value_heads": 1_024, "shared_intermediate_size": 262_144,
    "mamba_n_heads": 4_096, "mamba_d_head": 4_096, "mamba_n_groups": 1_024, "mamba_d_state": 4_096,
    "mamba_d_conv": 64, "mamba_expand": 16, "mamba_chunk_size": 65_536,
    "max_position_embeddings": 10_000_000,
}
REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "shared_intermediate_size")
MAMBA_SIZES = ("mamba_n_heads", "mamba_d_state", "mamba_d_conv", "mamba_n_groups", "mamba_expand")
FLOATS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
          "rms_norm_eps", "rope_theta")
BOOLS = ("attention_bias", "mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")


def is_int(v, lo: int = 0, hi: float = math.inf) -> bool:
    """An int in [lo, hi]; a bool is not one, though Python counts True as 1."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_finite(v) -> bool:
    """An int or float a float holds finitely (not NaN, infinity or an int past 1.8e308); a bool is not one."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # math.isfinite converts an int to a float first
        return False


def check_fields(obj, sizes: dict, numbers=(), error=ValueError, prefix: str = ""):
    """Refuse the first size of obj (name: (lo, hi)) that is not an integer in [lo, hi], then the first number that
    is not finite, naming the field."""
    for name, (lo, hi) in sizes.items():
        if not is_int(getattr(obj, name), lo, hi):
            raise error(f"{prefix}{name}: {getattr(obj, name)!r} is not an integer in [{lo}, {hi}]")
    for name in numbers:
        if not is_finite(getattr(obj, name)):
            raise error(f"{prefix}{name}: {getattr(obj, name)!r} is not a finite number")


def check_rules(rules, error=ValueError, prefix: str = ""):
    """Refuse the first (valid, message) rule that fails; a generator's rules may rely on those before them."""
    for valid, message in rules:
        if not valid:
            raise error(prefix + message)


class ConfigError(ValueError):
    """A config.json that nano_spec cannot build a model from; the message names the field."""


@dataclass
class ModelConfig:
    vocab_size: int                      # V
    hidden_size: int                     # D
    num_attention_heads: int             # Hq
    shared_intermediate_size: int        # MLP width
    layer_types: list = field(default_factory=list)  # per layer: "mamba" or "attention"
    num_key_value_heads: int = 0         # Hkv (0: = Hq)
    attention_bias: bool = False
    mamba_n_heads: int = 128             # H
    mamba_d_head: int = 0                # P (0 or "auto": mamba_expand * D / H)
    mamba_n_groups: int = 1              # G
    mamba_d_state: int = 256             # N
    mamba_d_conv: int = 4                # W
    mamba_expand: int = 2                # d_in = mamba_expand * D = H * P
    mamba_chunk_size: int = 256          # SSD chunk length for long prefills
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0    # attention score scale (replaces 1/sqrt(Dh))
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0          # logits are divided by this
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    position_embedding_type: str = "nope"  # "nope" or "rope"
    rope_theta: float = 10_000.0
    time_step_limit: tuple = (0.0, math.inf)  # clamp of dt after softplus
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0    # 1: the checkpoint has an MTP draft head

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def d_inner(self) -> int:  # d_in = H * P
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def conv_dim(self) -> int:  # C = d_in + 2 G N
        return self.d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def head_dim(self) -> int:  # Dh
        return self.hidden_size // self.num_attention_heads

    @property
    def mamba_layers(self) -> list:
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def attention_layers(self) -> list:
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def rope(self) -> float | None:  # rope_theta when RoPE is on, None for NoPE
        return self.rope_theta if self.position_embedding_type == "rope" else None

    @property
    def eos_ids(self) -> tuple:
        e = self.eos_token_id
        return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (e,)

    # ---- reading and writing -----------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        d = _decode_floats(d)
        _check_architecture(d)
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ConfigError(f"config.json: missing field(s) {', '.join(missing)}")
        if d.get("num_local_experts", 0) not in (0, None):
            raise ConfigError(f"num_local_experts: {d['num_local_experts']} experts; nano_spec supports only the "
                              "dense GraniteMoeHybrid (num_local_experts = 0)")
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        kw["layer_types"] = _layer_types(d)
        if kw.get("mamba_d_head", "auto") == "auto":
            kw.pop("mamba_d_head", None)
        kw["position_embedding_type"] = d.get("position_embedding_type") or "nope"
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        kw["time_step_limit"] = _time_step_limit(d.get("time_step_limit"))
        return cls(**kw)

    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """A config.json in the published Granite 4.0-H layout, which nano_spec, transformers and llama.cpp read."""
        # the published spelling: layer_types "mamba"/"attention" and position_embedding_type "nope"/"rope", which
        # llama.cpp's converter reads and transformers maps to its own names; and intermediate_size beside
        # shared_intermediate_size, the converter's feed-forward length
        d = asdict(self)
        d["intermediate_size"] = self.shared_intermediate_size
        d["time_step_limit"] = [_encode_float(x) for x in self.time_step_limit]
        if self.rope is not None:
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d.update(architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
                 num_hidden_layers=self.num_hidden_layers, num_local_experts=0, hidden_act="silu")
        return d

    def __post_init__(self):
        """Every field checked, whoever builds the config; num_key_value_heads and mamba_d_head 0 are filled in."""
        # num_hidden_layers is the property len(layer_types)
        check_fields(self, {name: (0, cap) for name, cap in LIMITS.items()}, FLOATS, ConfigError)
        check_rules(((isinstance(getattr(self, n), bool), f"{n}: {getattr(self, n)!r} is not true or false")
                     for n in BOOLS), ConfigError)  # the string "false" would count as true
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not a token id (an integer >= 0) or null")
        if not is_int(self.num_nextn_predict_layers):
            raise ConfigError(f"num_nextn_predict_layers: {self.num_nextn_predict_layers!r} is not an integer")
        if self.num_key_value_heads == 0:
            self.num_key_value_heads = self.num_attention_heads
        if self.mamba_d_head == 0 and self.mamba_n_heads > 0:
            self.mamba_d_head = self.mamba_expand * self.hidden_size // self.mamba_n_heads
        mamba = bool(self.mamba_layers)
        check_rules(((getattr(self, n) >= 1, f"{n}: must be positive, got {getattr(self, n)}")
                     for n in REQUIRED + (MAMBA_SIZES if mamba else ())), ConfigError)
        # every size is now a positive integer: the rules below can divide by them
        D, Hq, Hkv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        H, P, G, E = self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups, self.mamba_expand
        pos, mtp = self.position_embedding_type, self.num_nextn_predict_layers
        lo, hi = self.time_step_limit
        rules = (  # valid, the message naming the field
            (self.num_hidden_layers >= 1, "layer_types: the model needs at least one layer"),
            (D % Hq == 0, f"num_attention_heads: {Hq} does not divide hidden_size {D}"),
            (Hq % Hkv == 0, f"num_key_value_heads: {Hkv} does not divide num_attention_heads {Hq}"),
            (not mamba or H * P == E * D,
             f"mamba_d_head: {H} heads x {P} != mamba_expand * hidden_size = {E * D}"),
            (not mamba or H % G == 0, f"mamba_n_groups: {G} does not divide mamba_n_heads {H}"),
            (pos in ("nope", "rope"), f"position_embedding_type: {pos!r} is not 'nope' or 'rope'"),
            (self.rope is None or self.head_dim % 2 == 0,
             f"num_attention_heads: RoPE needs an even head dim, got {self.head_dim}"),
            (mtp in (0, 1),
             f"num_nextn_predict_layers: {mtp}; nano_spec's MTP head has one layer (0 or 1)"),
            (0 <= lo <= hi, f"time_step_limit: {self.time_step_limit} is not 0 <= lo <= hi"),
            (self.logits_scaling != 0 and self.rms_norm_eps > 0,
             "logits_scaling must be non-zero and rms_norm_eps positive"),
            (self.rope_theta > 0, f"rope_theta: {self.rope_theta!r} must be positive"),
            *((is_int(e, 0, self.vocab_size - 1), f"eos_token_id: {e!r} is not a token id below vocab_size "
               f"{self.vocab_size}") for e in self.eos_ids),  # true is not token 1
        )
        check_rules(rules, ConfigError)


def _check_architecture(d: dict):
    """Refuse other hybrids (NemotronH, Bamba, ...) by name, before any field-level message."""
    model_type = d.get("model_type")
    if model_type is not None and model_type != "granitemoehybrid":
        raise ConfigError(f"model_type: {model_type!r} is not supported; nano_spec runs the dense "
                          "GraniteMoeHybrid (model_type 'granitemoehybrid')")
    archs = d.get("architectures")
    if archs is not None and (not isinstance(archs, list) or "GraniteMoeHybridForCausalLM" not in archs):
        raise ConfigError(f"architectures: {archs!r} is not supported; nano_spec runs GraniteMoeHybridForCausalLM")


def _time_step_limit(v) -> tuple:
    """[lo, hi] of two numbers (hi may be infinity); absent or null means (0, inf)."""
    if v is None:
        return (0.0, math.inf)
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in v)):
        raise ConfigError(f"time_step_limit: expected [lo, hi] of two numbers, got {v!r}")
    return (float(v[0]), float(v[1]))


def _layer_types(d: dict) -> list:
    types = d.get("layer_types") or d.get("layers_block_type")
    if types is None:
        raise ConfigError("layer_types: missing (a list of 'mamba'/'linear_attention' and "
                          "'attention'/'full_attention', one per layer)")
    if not isinstance(types, list):
        raise ConfigError(f"layer_types: expected a list, got {type(types).__name__}")
    out = [LAYER_TYPES.get(t) if isinstance(t, str) else None for t in types]
    if None in out:
        i = out.index(None)
        raise ConfigError(f"layer_types[{i}]: unknown layer type {types[i]!r} "
                          f"(expected one of {tuple(LAYER_TYPES)})")
    n = d.get("num_hidden_layers")
    if n is not None and n != len(out):
        raise ConfigError(f"num_hidden_layers: {n} but layer_types lists {len(out)} layers")
    return out


def _decode_floats(obj):
    """transformers may write inf/nan as {"__float__": "Infinity"}."""
    if isinstance(obj, dict):
        return float(obj["__float__"]) if set(obj) == {"__float__"} else {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _encode_float(x: float):
    return x if math.isfinite(x) else {"__float__": "Infinity" if x > 0 else "-Infinity"}
