"""`IndexedView`: a read-only sequence whose items are computed from their index when asked, so
that a sequence over every registered client (1,000,000 of them) holds nothing per client."""
from __future__ import annotations

from abc import abstractmethod
from typing import Sequence, TypeVar, overload

T = TypeVar("T")


class IndexedView(Sequence[T]):
    """Indexing as a list's (negative indices from the end, slices as lists, IndexError past the
    end) over `_at(i)` for 0 <= i < len(self)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _at(self, i: int) -> T:
        """Item `i`, 0 <= i < len(self)."""

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(len(self)))]
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(f"index {i} out of range ({len(self)} items)")
        return self._at(j)
