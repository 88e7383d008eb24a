"""The one rule by which vidtune scores a video, in words and as names, without torch: what
`vidtune predict --help` prints, the registered model version's description states
(`tune.tracking.registry`), and `trainer.serving.scoring.video_score` computes for `vidtune predict`
and the served MLflow model alike.

Validation (`trainer.training.loop.evaluate` on `datasets.video.VideoClipDataset` with train=False) scores
one clip per video: `num_frames` frames `frame_stride` apart, centred in the video. The default
rule, `centre`, scores that same clip, so the accuracy over the validation videos at a 0.5
threshold is the val_acc the search reported. `max` and `mean` (over clip windows sliding every
`--window-stride` seconds) are explicit options: they look at the whole of a long video, and
their accuracy is not the reported one.
"""
from __future__ import annotations

CENTRE = "centre"
AGGREGATIONS = (CENTRE, "max", "mean")    # the first is the default
THRESHOLD = 0.5                            # P(violent) >= it: violent, as val_acc counts

SCORING_RULE = (
    "A video's score is P(violent) of one clip: the model's num_frames frames, frame_stride apart, "
    "centred in the video (a shorter video gets the largest stride that fits, or repeated frames) - "
    "the clip validation scored, so the accuracy over the validation videos at P >= 0.5 is the "
    "reported val_acc. Other aggregations are explicit options: `max` or `mean` over clip windows "
    "that slide every window_stride seconds (`vidtune predict --aggregation`, the served model's "
    "`params: {\"aggregation\": ...}`).")


def rule_sentence(aggregation: str = CENTRE) -> str:
    """The rule `aggregation` in one sentence (the default's is `SCORING_RULE`)."""
    if aggregation == CENTRE:
        return SCORING_RULE
    return (f"A video's score is the {aggregation} of P(violent) over its clip windows (the model's "
            "num_frames frames, frame_stride apart, a window every window_stride seconds, the last "
            "flush with the end); validation scored one centred clip per video instead, so this "
            "accuracy is not the reported val_acc.")
