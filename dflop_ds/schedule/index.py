"""ScheduledIndex: a dataset index that carries what the loss needs to know about its batch."""

from __future__ import annotations


class ScheduledIndex(int):
    """An ``int`` dataset index that also carries its global batch's loss denominator.

    A plain dataset indexes with it as with any int (``str()`` and ``f"{i}"`` give the number); a
    dataset or collate function that knows about it reads ``loss_denominator`` (label tokens of
    the whole global batch divided by ``gradient_accumulation_steps * dp_world_size``) and
    ``batch_id``. The Trainer's sampler yields plain ``int`` s instead (its loss counts labels).
    """

    loss_denominator: float
    batch_id: int

    def __new__(cls, index: int, loss_denominator: float, batch_id: int = 0) -> ScheduledIndex:
        obj = super().__new__(cls, index)
        obj.loss_denominator = float(loss_denominator)
        obj.batch_id = int(batch_id)
        return obj

    def __reduce__(self):
        return (ScheduledIndex, (int(self), self.loss_denominator, self.batch_id))

    def __str__(self) -> str:
        """The number alone, as a plain ``int`` prints (``str(i)``, ``f"{i}"``, file names, keys)."""
        return str(int(self))

    def __repr__(self) -> str:
        return f"ScheduledIndex({int(self)}, loss_denominator={self.loss_denominator:g}, batch_id={self.batch_id})"
