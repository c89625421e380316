"""The weights' versions, kept in one record (`Runtime.versions`): a training node's version is the
number of updates it has made; a `weights_from` consumer holds the version of its trainer's weights
it last received. The runtime counts the updates, the syncs move the consumers up, the schedules read
how far behind they are, and checkpoints save both."""

from __future__ import annotations

from dataclasses import dataclass

NOT_SYNCED = -1  # a consumer's version before it got any weights from its trainer (the start-up sync brings it to 0)


@dataclass
class WeightVersions:
    trainer: dict[str, int]  # training node -> its weights' version (the updates it has made)
    held: dict[str, int]  # weights_from consumer -> the version of its trainer's weights it holds
    source: dict[str, str]  # weights_from consumer -> its trainer

    @classmethod
    def of(cls, pipe) -> "WeightVersions":
        """Before anything ran: every trainer at 0, every consumer NOT_SYNCED."""
        source = {n.id: n.weights_from for n in pipe.nodes.values() if n.weights_from}
        return cls({n: 0 for n in pipe.nodes if pipe.kinds[n].trains}, dict.fromkeys(source, NOT_SYNCED), source)

    def behind(self, consumer: str) -> int:
        """The versions `consumer`'s weights are behind its trainer's."""
        return self.trainer[self.source[consumer]] - self.held[consumer]
