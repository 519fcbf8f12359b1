"""The curve names a client gives a run (native `log`), bounded: how many a run may have
(`caps.max_metric_names`) and how long one may be (`caps.max_metric_name_chars`).

A name is a series on the run page and in its JSON, a row group in the store and an entry in the
curves' journal, so a tenant logging thousands of new names per call would grow all of them without
bound (two calls of 5,000 new 1,000-character names made one run page 10.5 MB). Past either limit
the call is a 400 naming the limit and nothing of it is stored. The names a run already has are read
once from the store and then kept here, for the most recently logged runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from twinkle.serve.errors import BadRequest

KEPT_RUNS = 1024  # runs whose names are held in memory (others are read back from the store on use)


class CurveNames:
    def __init__(self, curves, caps):
        self.curves, self.caps = curves, caps
        self._known: OrderedDict[str, set[str]] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, model_id: str, names: Iterable[str]) -> None:
        """Refuse (400) names past the limits; else remember them as the run's."""
        names = set(names)
        most, chars = self.caps.max_metric_names, self.caps.max_metric_name_chars
        long = next((n for n in names if len(n) > chars), None)
        if long is not None:
            raise BadRequest(
                f"metrics: the name {long[:40]!r}... has {len(long)} characters; at most {chars} "
                "(caps.max_metric_name_chars)"
            )
        with self._lock:  # one run's check and record at a time: two calls cannot both take the last names
            known = self._known.pop(model_id, None)
            if known is None:
                known = self.curves.names(model_id)
            new = names - known
            if len(known) + len(new) > most:
                self._known[model_id] = known
                raise BadRequest(
                    f"metrics: model {model_id!r} has {len(known)} curve names and this call adds {len(new)} new "
                    f"ones; a run may have at most {most} (caps.max_metric_names)"
                )
            self._known[model_id] = known | new
            while len(self._known) > KEPT_RUNS:
                self._known.popitem(last=False)
