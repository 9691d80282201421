"""Code that runs inside the vLLM server process, not in the trainer.

This directory is put on the server's PYTHONPATH (see launcher.plugin_path), so its modules are
imported there under their own top-level names; it holds nothing else, so nothing of
megatron_rl (whose module names could shadow the standard library's, e.g. `http`) is exposed to
the server's interpreter. Modules here import only what the vLLM environment has (the standard
library; vllm and torch for the weight-transfer engine), never megatron_rl:

    megatron_rl_vllm_auth.py   the bearer-key middleware (--middleware), standard library only
    megatron_rl_vllm_gloo.py   the gloo weight-transfer engine (--worker-extension-cls)
    megatron_rl_vllm_store.py  its rendezvous store, served by the trainer to token holders only
                               (torch and the standard library; the trainer imports it too)
"""
