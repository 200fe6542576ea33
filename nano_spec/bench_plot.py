"""python -m nano_spec.bench --plot PNG: tau and speedup against γ, and accept_at by draft position, per batch."""
import sys


def plot(rows, path):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'nano-spec[plot]'", file=sys.stderr)
        return
    plt.switch_backend("Agg")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        mtp = sorted((r for r in rows if r["batch"] == b and r["proposer"] in ("none", "mtp") and r["gamma"] != "auto"),
                     key=lambda r: r["gamma"])
        ax1.plot([r["gamma"] for r in mtp], [r["tau"] or 1.0 for r in mtp], "o-", label=f"tau, batch {b}")
        ax1.plot([r["gamma"] for r in mtp], [r["speedup"] for r in mtp], "s--", label=f"speedup, batch {b}")
        top = mtp[-1]
        positions = range(len(top["accept_at"]))
        ax2.bar([j + i * width for j in positions], top["accept_at"], width, label=f"batch {b}, γ={top['gamma']}")
    ax1.set(xticks=[r["gamma"] for r in mtp], xlabel="γ (drafts per step)")
    ax2.set(xticks=[j + (len(batches) - 1) * width / 2 for j in positions], xticklabels=[str(j) for j in positions],
            xlabel="draft position j", ylabel="accept_at[j]")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
