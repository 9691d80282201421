"""Secrets never reach the vLLM server's command line (visible to `ps`, written to server.log, kept in
every checkpoint's config): a flag is matched as vLLM's parser reads it. Its FlexibleArgumentParser
takes `_` for `-` and `.` for a field of a dict-valued flag, and argparse takes any unambiguous
prefix of a flag for the flag, so `--hf_tok=S` is `--hf-token S` to the server."""
import pytest

from megatron_rl.rollout.vllm.config import VllmConfig, secret_flag


@pytest.mark.parametrize("arg,flag", [
    ("--hf-token", "hf-token"), ("--hf-tok=S", "hf-token"), ("--hf_tok=S", "hf-token"), ("--hf_tok", "hf-token"),
    ("--HF-TOKEN=S", "hf-token"), ("--hf-token.x=S", "hf-token"), ("--hf-t", "hf-token"),
    ("--api-ke", "api-key"), ("--api_k=S", "api-key"), ("--s3-secret=S", "s3-secret-access-key"),
    ("--s3-access-key", "s3-access-key-id"), ("--db-password=S", "db-password"), ("--auth_secret", "auth-secret"),
])
def test_a_flag_is_read_as_vllm_reads_it(arg, flag):
    assert secret_flag(arg) == flag


@pytest.mark.parametrize("arg", ["--max-num-batched-tokens", "--tokenizer-mode=slow", "--ssl-keyfile", "k.pem",
                                 "--hf-overrides", "--api-server-count=2", "--", "hf-token", "-tp"])
def test_other_flags_and_values_pass(arg):
    assert secret_flag(arg) is None


@pytest.mark.parametrize("args", [["--hf-tok=hf_S3CR3T"], ["--hf_tok=hf_S3CR3T"], ["--hf-tok", "hf_S3CR3T"],
                                  ["--hf_token.x", "hf_S3CR3T"]])
def test_abbreviated_secret_flags_are_refused_without_echoing_the_value(args):
    with pytest.raises(ValueError, match=r"looks like a secret \(vLLM reads it as --hf-token\); pass it in "
                                         r"rollout.vllm.env") as e:
        VllmConfig(extra_args=args)
    assert "S3CR3T" not in str(e.value)


@pytest.mark.parametrize("args", [["--api-ke", "K"], ["--api_ke=K"], ["--api-k=K"]])
def test_abbreviated_api_key_flags_are_refused(args):
    with pytest.raises(ValueError, match=r"no --api-key \(--api"):
        VllmConfig(extra_args=args)


def test_ordinary_extra_args_pass():
    VllmConfig(extra_args=["--max-num-batched-tokens", "4096", "--tokenizer-mode", "slow", "--ssl-keyfile", "k.pem",
                           "--hf-overrides.max_model_len=8"])
