"""Which of a dataset's two classes is the violent one: from `--positive-class`, or from the
class names themselves (Fight / NonFight, Violence / NonViolence, fight / no_fight, ...)."""
from __future__ import annotations

import re

from vidtune.datasets.records import NON_VIOLENT, VIOLENT
from vidtune.errors import DataError

# Matched against the class name lower-cased with everything but letters and digits removed,
# so "Non_Fight", "no fight" and "NonFight" all read "nonfight" / "nofight".
_POSITIVE_STEMS = ("fight", "violen", "assault", "aggress", "abuse", "attack", "brawl", "riot",
                   "shoot", "robber", "vandal", "punch", "weapon", "anomal", "abnormal")
_NEGATIVE_PREFIXES = ("non", "not", "no")
_NEGATIVE_NAMES = frozenset({"normal", "normalvideos", "neutral", "peaceful", "peace", "calm",
                             "safe", "benign", "negative", "nonviolent", "nonviolence"})


def _norm(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def is_negative_name(name: str) -> bool:
    """True for names of the non-violent class: NonFight, NonViolence, no_fight, normal, ..."""
    n = _norm(name)
    if n in _NEGATIVE_NAMES:
        return True
    return any(n.startswith(pre) and n[len(pre):].startswith(_POSITIVE_STEMS) for pre in _NEGATIVE_PREFIXES)


def is_positive_name(name: str) -> bool:
    """True for names of the violent class: Fight, fights, Violence, violent, assault, ..."""
    return _norm(name).startswith(_POSITIVE_STEMS) and not is_negative_name(name)


def resolve_positive(names: list[str], positive_class: str | None, *, where: str) -> dict[str, int]:
    """Map the two class names to labels (1 = violent) from `positive_class` or from the names."""
    if positive_class is not None:
        hits = [n for n in names if n == positive_class] or \
               [n for n in names if n.lower() == positive_class.lower()]
        if len(hits) != 1:
            raise DataError(f"--positive-class {positive_class!r} is not one of the classes found in "
                            f"{where}: {', '.join(repr(n) for n in sorted(names))}")
        positive = hits[0]
    else:
        pos = [n for n in names if is_positive_name(n)]
        neg = [n for n in names if is_negative_name(n)]
        if len(pos) == 1:
            positive = pos[0]
        elif not pos and len(neg) == 1:
            positive = next(n for n in names if n != neg[0])
        else:
            raise DataError(f"cannot tell which class is violent among the classes found in {where}: "
                            f"{', '.join(repr(n) for n in sorted(names))}; pass --positive-class NAME "
                            "(DataConfig.positive_class) naming the violent one")
    return {n: (VIOLENT if n == positive else NON_VIOLENT) for n in names}


def names_by_label(labels: dict[str, int]) -> dict[int, str]:
    """{label: class name}, the violent class (1) first."""
    return {lab: name for name, lab in sorted(labels.items(), key=lambda kv: -kv[1])}
