"""Which DeltaNet state slot each running sequence of a hybrid model holds.

A hybrid model's DeltaNet layers keep one fixed-size state per running sequence
(`serving/model/hybrid/slots.py`), so a sequence runs only while it holds a slot as well as
its KV blocks: the scheduler takes one at admission and gives it back at finish, abort and
preemption. A preempted sequence is recomputed from its first token into whatever slot it
gets next, as its KV blocks are.
"""

from serving.engine.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def allocate(self, seq: Sequence) -> bool:
        """Give the sequence a slot unless it holds one; False when none is free."""
        if seq.state_slot is None:
            if not self.free:
                return False
            seq.state_slot = self.free.pop()
        return True

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free.append(seq.state_slot)
            seq.state_slot = None
