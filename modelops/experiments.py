"""Experiments: a model's unpinned requests split between versions (arms) by a stable hash of a
key the client sends, so the same user always gets the same arm, whatever the instance counts.

The arm of a request: ``crc32(key) mod 100`` (the key's bytes as sent: a header's value, or the
body's top-level ``user`` string with its JSON quotes) falls in one arm's slice of 0..99, in
the order the arms were given. The router computes it with HAProxy's ``crc32`` converter, which
is the CRC-32 of Ethernet, gzip and zlib (HAProxy 2.6 configuration manual, ``crc32``), so
:func:`arm_of` here gives the same answer. A request without the key, or with one longer than
:data:`MAX_KEY_BYTES`, goes to the default arm (the first, unless given) and is counted so.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

__all__ = ["MAX_KEY_BYTES", "Arm", "ExperimentSpec", "arm_of", "bucket_of", "parse_arms", "parse_key"]

MAX_KEY_BYTES = 256  # a longer key goes to the default arm (the router hashes no more per request)
_HEADER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


@dataclass(frozen=True)
class Arm:
    """One arm: ``version`` gets ``percent`` (1..99) of the keys."""

    version: str
    percent: int


@dataclass(frozen=True)
class ExperimentSpec:
    """What the router needs of an experiment: its ``arms`` (in order, summing to 100), the
    ``key`` (``"user"``: the body's top-level ``user``; ``"header:<Name>"``) and the ``default``
    arm's version (for requests without a usable key)."""

    arms: tuple[Arm, ...]
    key: str
    default: str

    @property
    def header(self) -> str | None:
        """The header named by ``key``, or None when the key is the body's ``user``."""
        return self.key.split(":", 1)[1] if self.key.startswith("header:") else None

    def slices(self) -> list[tuple[str, int, int]]:
        """``(version, lo, hi)``: the arm whose slice holds buckets ``lo <= b < hi``."""
        out, lo = [], 0
        for arm in self.arms:
            out.append((arm.version, lo, lo + arm.percent))
            lo += arm.percent
        return out


def parse_arms(text: str, serving: set[str]) -> tuple[Arm, ...]:
    """``"1:50,2:50"`` → arms. Every version must be in ``serving``, once, each with 1..99
    percent, summing to 100.

    Raises:
        ValueError: naming ``--arms`` and what to change.
    """
    arms = []
    for part in (p.strip() for p in text.split(",")):
        version, sep, percent = part.partition(":")
        if not sep or not version or not percent.strip().isdigit():
            raise ValueError(f"--arms: {part!r} is not VERSION:PERCENT; write e.g. --arms 1:50,2:50")
        arms.append(Arm(version.strip(), int(percent)))
    versions = [a.version for a in arms]
    if len(arms) < 2:
        raise ValueError("--arms: an experiment needs at least two arms, e.g. --arms 1:50,2:50")
    if dup := sorted({v for v in versions if versions.count(v) > 1}):
        raise ValueError(f"--arms: version {', '.join(dup)} is named twice; give each version one share")
    if bad := [a for a in arms if not 1 <= a.percent <= 99]:
        raise ValueError(f"--arms: {bad[0].version}:{bad[0].percent}: each arm takes 1 to 99 percent")
    if (total := sum(a.percent for a in arms)) != 100:
        raise ValueError(f"--arms: the shares sum to {total}, not 100")
    if missing := [v for v in versions if v not in serving]:
        raise ValueError(f"--arms: version {', '.join(missing)} is not serving (serving: "
                         f"{', '.join(sorted(serving)) or 'none'}); an arm needs a serving version")
    return tuple(arms)


def parse_key(text: str) -> str:
    """``user`` (the body's top-level ``user``) or ``header:<Name>`` (a header, e.g.
    ``header:X-User-Id``); returned normalized (``header:x-user-id``).

    Raises:
        ValueError: naming ``--key`` and the forms it takes.
    """
    if text == "user":
        return text
    kind, _, name = text.partition(":")
    if kind == "header" and _HEADER.match(name):
        return f"header:{name.lower()}"
    raise ValueError(f"--key: {text!r} is neither `user` (the request body's user field) nor `header:<Name>` "
                     "(e.g. header:X-User-Id)")


def bucket_of(key: bytes) -> int:
    """The key's bucket, 0..99, as the router computes it (HAProxy ``crc32,mod(100)``)."""
    return zlib.crc32(key) % 100


def arm_of(spec: ExperimentSpec, key: bytes | None) -> str:
    """The version that answers a request with ``key`` (None: no key; the default arm)."""
    if key is None or not key or len(key) > MAX_KEY_BYTES:
        return spec.default
    b = bucket_of(key)
    return next(v for v, lo, hi in spec.slices() if lo <= b < hi)
