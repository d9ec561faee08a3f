"""The engine-side library: :class:`Client` / :class:`AsyncClient` over a daemon's socket,
attachments and per-layer views of the arena. It speaks only the wire (kvd.rpc, kvd.records)."""

from kvd.client.attach import Attachment
from kvd.client.client import Client, AsyncClient, Ended, PoolInfo, LeaseInfo, TransferStatus, SendResult, SendSpec, SendOutcomes, TransferState

__all__ = ["Client", "AsyncClient", "Ended", "PoolInfo", "LeaseInfo", "Attachment", "TransferStatus", "SendResult", "SendSpec", "SendOutcomes", "TransferState"]
