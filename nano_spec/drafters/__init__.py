"""The drafters: where the γ tokens a step verifies come from (base.py: what a drafter is)."""
