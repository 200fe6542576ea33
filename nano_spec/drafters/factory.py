"""The drafter the settings chose (nano_spec/engine/settings.py), built for a loaded model."""
from nano_spec.drafters.base import Checked, NoDrafter
from nano_spec.drafters.dflash import DFlashDrafter
from nano_spec.drafters.mtp import MTPDrafter
from nano_spec.drafters.ngram import NgramDrafter
from nano_spec.model.cache import cache_len
from nano_spec.model.dflash import load_drafter


def make_drafter(c, model):
    """c: an EngineConfig. An outside object is wrapped in Checked; a DFlash drafter is read from c.drafter_dir."""
    num_slots, max_len = c.max_batch, cache_len(c.max_seq_len, c.max_drafts)
    if not isinstance(c.drafter, str):
        return Checked(c.drafter, c.cfg.vocab_size, c.device)
    if c.drafter == "mtp":
        return MTPDrafter(model, c.max_drafts, num_slots, max_len)
    if c.drafter == "dflash":
        block = load_drafter(c.drafter_dir, c.dflash, model.ops, c.device, c.dtype)
        return DFlashDrafter(block, model, c.max_drafts, num_slots, max_len)
    return NgramDrafter(c.max_drafts, c.device) if c.drafter == "ngram" else NoDrafter()
