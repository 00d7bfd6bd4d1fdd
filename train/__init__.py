"""dspark-train: self-distillation of a DSpark drafter from its own target.

data (prompts -> target generations with features and top-k logits, cached on disk) -> vocab (reduced draft
vocabulary) -> model (teacher-forced block forward over many anchors) -> losses (position-weighted CE + TV/KL +
confidence BCE on the soft acceptance label) -> calibrate (per-position confidence temperatures) -> cli.
"""
