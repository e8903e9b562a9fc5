"""tandem's plugin for vLLM servers: follow a delta-sync weight stream in place.

Start a server with ``--worker-extension-cls tandem.vllm_plugin.DeltaSyncExtension`` (and
``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``); tandem's vLLM engine then drives it:
``tandem_follow`` (the store, the version the server holds, the checkpoint layout),
``tandem_prepare`` (download, verify and decode the next version in a background thread
while the server keeps serving), ``tandem_status``, and ``tandem_apply`` (the pause: patch
the weights in place). Installed into the vLLM environment with only tandem-delta-sync
beside it; nothing else of tandem.
"""

from tandem.vllm_plugin.worker import DeltaSyncExtension

__all__ = ["DeltaSyncExtension"]
