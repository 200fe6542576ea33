"""Sampling parameters, token picks and the accept rule (docs/DESIGN.md §5).

Greedy rows (temperature 0) use the verdict_greedy kernel; sampled rows use the lossless
rejection rule of verdict_sample. Both stay on the device: the accept rule returns
tensors, and the runner copies them to the host once per step.
"""
from dataclasses import dataclass

import torch

from nano_spec_kernels.verdict_greedy import unpack_bitmask
from nano_spec_kernels.verdict_sample import sampling_probs_ref
from nano_spec.model.config import check_rules, is_finite, is_int


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0      # 0: greedy
    top_k: int = 0                # 0: off
    top_p: float = 1.0            # 1: off
    seed: int | None = None       # sampled requests with a seed are reproducible
    stop: tuple = ()              # stop strings (not included in the output text)
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int = 0             # 0: none; n >= 1: each token's logprob and the top-n alternatives
    json_schema: dict | str | None = None  # structured output (nano_spec/text/grammar.py): at most one of
    regex: str | None = None               # a JSON schema, a regular expression the whole output matches,
    grammar: str | None = None             # or a Lark grammar

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        t, ids = self.temperature, self.stop_token_ids
        rules = (  # field, valid, what it must be
            ("max_new_tokens", is_int(self.max_new_tokens, 1), "an integer >= 1"),
            ("temperature", is_finite(t) and t >= 0, "a finite number >= 0"),  # True is no number
            ("top_k", is_int(self.top_k, 0, 2**31 - 1), "an integer in [0, 2**31 - 1]"),  # 2**63 overflowed int64
            ("top_p", is_finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or is_int(self.seed, 0, 2**64 - 1), "None or an integer in [0, 2**64)"),
            ("stop", isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
             "a string or a list of non-empty strings"),
            ("stop_token_ids", isinstance(ids, (list, tuple)) and all(map(is_int, ids)),
             "a list of token ids >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("logprobs", is_int(self.logprobs, 0, 20), "an integer in [0, 20]"),
            ("json_schema", self.json_schema is None or isinstance(self.json_schema, (dict, str)),
             "None, a dict or a JSON string"),
            ("regex", self.regex is None or isinstance(self.regex, str), "None or a string"),
            ("grammar", self.grammar is None or isinstance(self.grammar, str), "None or a Lark grammar string"),
        )
        check_rules((valid, f"SamplingParams.{name}: must be {what}, got {getattr(self, name)!r}")
                    for name, valid, what in rules)
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"SamplingParams.{given[1]}: {' and '.join(given)} given; use at most one of "
                             "json_schema, regex, grammar")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """A sampled request with top-k or top-p on: its probabilities need a sort over the vocabulary."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


@dataclass
class BatchSampling:
    """Per-row sampling settings of one batch, as device tensors (B,)."""
    greedy: torch.Tensor       # bool
    temperature: torch.Tensor  # float; 1 on greedy rows (unused there)
    top_k: torch.Tensor        # long
    top_p: torch.Tensor        # float
    all_greedy: bool           # host-known: no row is sampled
    filtered: bool = False     # host-known: some row has top-k or top-p on (else no sort is run)

    @classmethod
    def of(cls, params: list, device) -> "BatchSampling":
        greedy = [p.greedy for p in params]
        return cls(greedy=torch.tensor(greedy, device=device),
                   temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device),
                   top_k=torch.tensor([p.top_k for p in params], device=device),
                   top_p=torch.tensor([float(p.top_p) for p in params], device=device),
                   all_greedy=all(greedy), filtered=any(p.filters for p in params))

    def select(self, idx, all_greedy: bool, filtered: bool) -> "BatchSampling":
        """The rows idx; all_greedy and filtered are known on the host. An all-greedy batch reads no per-row
        setting, so nothing is gathered for it."""
        if all_greedy:
            return GREEDY
        return BatchSampling(self.greedy[idx], self.temperature[idx], self.top_k[idx], self.top_p[idx], False,
                             filtered)

    def write(self, row: int, one: "BatchSampling"):
        """Row `row` takes the settings of a one-row BatchSampling (per-slot settings, at admission)."""
        for name in ("greedy", "temperature", "top_k", "top_p"):
            getattr(self, name)[row] = getattr(one, name)[0]

    def pick(self, logits, uniforms, bitmask=None):
        """One token per row from logits (B, V): argmax on greedy rows, an inverse-CDF draw with
        uniforms (B,) on sampled rows; only among the tokens a grammar bitmask (B, Vw) allows, if given.
        Returns (tokens (B,), probs (B, V) or None when all greedy)."""
        logits = masked(logits, bitmask)
        greedy_tok = logits.float().argmax(-1)
        if self.all_greedy:
            return greedy_tok, None
        probs = sampling_probs_ref(logits[:, None], self.temperature, self.top_k, self.top_p,
                                   self.filtered)[:, 0]  # (B, V)
        cdf = probs.cumsum(-1)
        drawn = (cdf <= uniforms[:, None] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
        return torch.where(self.greedy, greedy_tok, drawn), probs


GREEDY = BatchSampling(None, None, None, None, all_greedy=True)  # every row greedy: argmax, no settings read


def masked(logits, bitmask):
    """logits (..., V) with the tokens a bitmask (..., Vw) disallows at -inf (a copy); unchanged without one.
    A sampled row then applies temperature, top-k and top-p among the allowed tokens only."""
    return logits if bitmask is None else logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def accept_rule(ops, logits, drafts, nd, sampling: BatchSampling, q=None, uniforms=None, bitmask=None):
    """Judge K = γ + 1 verified rows per sequence.

    logits (B, K, V), drafts (B, γ), nd (B,) real drafts, q (B, γ, V) the drafts' distributions (sampled
    rows), uniforms (B, K), bitmask (B, K, Vw) or None -> (na (B,), emitted (B, K)) where emitted[b, j] is the
    token emitted at row j for j <= na[b] (accepted drafts, then the target's pick).
    """
    picks, na = ops.verdict_greedy(logits, drafts, nd, bitmask)  # the mask is applied in the pass
    if sampling.all_greedy:
        return na, picks
    # the target p is the masked one; the drafts' q were masked alike
    na_s, tok_s = ops.verdict_sample(masked(logits, bitmask), q, drafts, nd, uniforms,
                                     sampling.temperature, sampling.top_k, sampling.top_p, sampling.filtered)
    j = torch.arange(logits.shape[1], device=logits.device)
    padded = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)  # (B, K)
    sampled = torch.where(j < na_s[:, None], padded, tok_s[:, None])
    return torch.where(sampling.greedy, na, na_s), torch.where(sampling.greedy[:, None], picks, sampled)


def token_logprobs(logits, tokens, top_n: int):
    """Log-probabilities under the target (log_softmax of the logits): logits (B, K, V), tokens (B, K),
    top_n >= 1 -> (logprob (B, K), top values (B, K, n), top ids (B, K, n))."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return (lp.gather(-1, tokens[..., None])[..., 0], *lp.topk(top_n, dim=-1))
