"""The lookup drafters, zero parameters, one n-gram index (`TokenIndex`): `ngram` copies out of the current request,
`history` out of the requests served before it."""

from .history import HistoryDrafter, HistoryOptions
from .ngram import NgramDrafter, NgramOptions, TokenIndex

__all__ = ["HistoryDrafter", "HistoryOptions", "NgramDrafter", "NgramOptions", "TokenIndex"]
