"""Speculative decoding of one sequence, the whole algorithm in one screen (docs/DESIGN.md §10).

No batching, no caches, no kernels: every step re-runs the model's no-cache forward over the whole sequence. Drafts
come from the MTP head or n-gram lookup; the accept rule is greedy, or the lossless rejection rule when sampling (§5).
The engine must emit exactly these tokens; tests/test_reference.py holds it to that. Random numbers are drawn in the
engine's order: 1 for the first token, then per step γ for the drafts and K = γ + 1 for the accept rule.
"""
import torch


def ngram_lookup(tokens: list, gamma: int, max_n: int = 3) -> list:
    """Up to γ tokens that followed the latest earlier occurrence of the longest matching suffix: the plain scan
    (the engine's NgramDrafter finds the same through its index)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), 0, -1):
        tail = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + gamma]
    return []


def filtered(logits, temperature: float, top_k: int, top_p: float):
    """logits (V,) -> the distribution a sampled row draws from: temperature, then top-k, then top-p."""
    shifted = (logits.float() - logits.float().max()) / max(temperature, torch.finfo(torch.float32).tiny)
    if not top_k and top_p >= 1:  # no filter: the whole distribution
        return torch.softmax(shifted, -1)
    p, order = torch.softmax(shifted, -1).sort(descending=True)  # the shift keeps a tiny T from overflowing
    if top_k:
        p[top_k:] = 0
    p = p / p.sum()
    p = p * (p.cumsum(0) - p < top_p)  # the smallest prefix whose mass reaches top_p (never empty)
    return torch.zeros_like(p).scatter(0, order, p / p.sum())


def draw(p, u) -> int:
    """Inverse-CDF draw of one token from p (V,) with a uniform u."""
    return int((p.cumsum(0) <= u * p.sum()).sum().clamp(max=len(p) - 1))


@torch.no_grad()
def speculative_generate(model, prompt: list, max_new_tokens: int, gamma: int = 3, proposer: str = "mtp",
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                         eos_ids=()) -> tuple:
    """-> (generated tokens, origin of each: "prefill", "draft", "correction" or "bonus")."""
    greedy, gen = temperature == 0, torch.Generator().manual_seed(seed)
    rand = lambda n: [None] * n if greedy else torch.rand(n, generator=gen)  # noqa: E731
    dist = lambda logits: filtered(logits, temperature, top_k, top_p)  # noqa: E731
    pick = lambda logits, u: int(logits.argmax()) if greedy else draw(dist(logits), u)  # noqa: E731
    tokens, out, origins = list(prompt), [], []

    def emit(token, origin) -> bool:  # True when the sequence is finished
        tokens.append(token), out.append(token), origins.append(origin)
        return token in eos_ids or len(out) >= max_new_tokens

    def propose(u):  # -> γ drafts and the distribution each was drawn from
        if proposer == "ngram":
            drafts = ngram_lookup(tokens, gamma)
            return drafts, [torch.nn.functional.one_hot(torch.tensor(d), model.cfg.vocab_size) for d in drafts]
        x = torch.tensor(tokens)[None]
        h, nxt, drafts, qs = model.hidden(x[:, :-1]), x[:, 1:], [], []  # h_p and x_{p+1}, p = 0..n-2
        for i in range(gamma):
            o = model.mtp_hidden(nxt, h)[:, -1:]  # (1, 1, D): predicts the token after nxt[-1]
            logits = model.mtp_logits(o[0, 0])
            drafts.append(pick(logits, u[i]))
            qs.append(None if greedy else dist(logits))
            h, nxt = torch.cat([h, o], 1), torch.cat([nxt, torch.tensor([[drafts[-1]]])], 1)  # recurse on o
        return drafts, qs

    if emit(pick(model(torch.tensor(tokens)[None])[0, -1], rand(1)[0]), "prefill"):
        return out, origins
    while True:
        drafts, qs = propose(rand(gamma) if gamma else None)
        u = rand(gamma + 1)
        logits = model(torch.tensor(tokens + drafts)[None])[0, len(tokens) - 1 :]  # (nd + 1, V)
        for j, d in enumerate(drafts):  # accept while the target agrees (or with probability min(1, p/q))
            ok = d == int(logits[j].argmax()) if greedy else u[j] * qs[j][d] < dist(logits[j])[d]
            if not ok:
                break
            if emit(d, "draft"):
                return out, origins
        else:
            j = len(drafts)
        if greedy or j == len(drafts):
            v = pick(logits[j], u[-1])
        else:  # after a rejection: the residual max(0, p - q) keeps the output exact
            p = dist(logits[j])
            r = (p - qs[j]).clamp(min=0)
            v = draw(r if r.sum() > 0 else p, u[-1])
        if emit(v, "bonus" if j == len(drafts) else "correction"):
            return out, origins
