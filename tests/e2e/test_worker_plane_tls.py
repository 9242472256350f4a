"""The worker plane over mutual TLS (serve --worker-tls-*): a TP=2 cluster of Ray actors (tiny model, loopback)
whose workers serve only TLS and accept only callers holding a certificate of the launch's CA. It generates the
reference tokens; a plaintext caller that even knows the secret, and a TLS caller whose certificate another CA
signed, cannot complete a call; the serve command refuses half the flags and files it cannot read."""

from __future__ import annotations

import argparse
import subprocess

import grpc
import pytest

from shardserve.client.clients import Client
from shardserve.proto import worker_pb2 as pb
from shardserve.proto import worker_pb2_grpc as pb_grpc
from shardserve.proto.auth import WORKER_TLS_NAME, WorkerTLS
from shardserve.proto.transport import worker_channel
from tests.hf_reference import assert_greedy_match, hf_greedy

PROMPT = [1, 17, 42, 99, 7, 250, 3]
NUM_NEW = 8


def _make_ca_and_cert(d, prefix: str) -> WorkerTLS:
    """A CA and a certificate it signed for the workers' name (server and client use alike)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{prefix}ca.key", "-out", f"{prefix}ca.pem",
        "-days", "2", "-subj", f"/CN={prefix}worker CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{prefix}w.key", "-out", f"{prefix}w.csr",
        "-subj", f"/CN={WORKER_TLS_NAME}")
    (d / f"{prefix}w.ext").write_text(f"subjectAltName=DNS:{WORKER_TLS_NAME}\n")
    run("x509", "-req", "-in", f"{prefix}w.csr", "-CA", f"{prefix}ca.pem", "-CAkey", f"{prefix}ca.key",
        "-CAcreateserial", "-out", f"{prefix}w.pem", "-days", "2", "-extfile", f"{prefix}w.ext")
    return WorkerTLS(str(d / f"{prefix}w.pem"), str(d / f"{prefix}w.key"), str(d / f"{prefix}ca.pem"))


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory) -> tuple[WorkerTLS, WorkerTLS]:
    d = tmp_path_factory.mktemp("worker-certs")
    return _make_ca_and_cert(d, ""), _make_ca_and_cert(d, "stranger-")


@pytest.fixture(scope="module")
def tls_cluster(ray_session, tiny_llama_dir, e2e_config, tls_pair):
    from shardserve.launch.ray_serving import start_cluster

    running = start_cluster(e2e_config(tiny_llama_dir, tensor_parallel_size=2), host="127.0.0.1", port=0,
                            worker_tls=tls_pair[0])
    yield running
    running.shutdown(drain_timeout_s=0)


def _health(channel: grpc.Channel) -> pb.HealthResponse:
    try:
        return pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
    finally:
        channel.close()


def test_a_tls_worker_plane_serves_the_reference_tokens(tls_cluster, tiny_llama_dir):
    reference = hf_greedy(tiny_llama_dir, [PROMPT], NUM_NEW)[0]
    with Client(tls_cluster.address, timeout=120) as client:
        tokens = client.generate(PROMPT, max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True).token_ids
    assert_greedy_match(tokens, reference)


def test_only_a_certificate_of_the_launch_ca_reaches_a_worker(tls_cluster, tls_pair):
    ours, stranger = tls_pair
    (group,) = tls_cluster.worker_groups()
    assert group.tls == ours
    for endpoint in group.endpoints:
        assert _health(worker_channel(endpoint, group.secret, ours)).state == pb.WORKER_STATE_READY
        for channel in (worker_channel(endpoint, group.secret),  # plaintext, with the secret
                        worker_channel(endpoint, group.secret, stranger)):  # TLS, another CA's certificate
            with pytest.raises(grpc.RpcError) as refused:
                _health(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake, no call
    assert tls_cluster.status()["state"] == "serving"


def test_the_serve_flags_go_together_and_the_files_must_be_readable(tls_pair, tmp_path):
    from shardserve.cli.server_commands import worker_tls

    ours = tls_pair[0]

    def args(cert=None, key=None, ca=None):
        return argparse.Namespace(worker_tls_cert=cert, worker_tls_key=key, worker_tls_ca=ca,
                                  worker_tls_server_name=WORKER_TLS_NAME)

    assert worker_tls(args()) is None
    assert worker_tls(args(ours.cert, ours.key, ours.ca)) == ours
    with pytest.raises(ValueError, match="go together"):
        worker_tls(args(ours.cert, ours.key))
    with pytest.raises(ValueError, match="key .*missing.pem cannot be read"):
        worker_tls(args(ours.cert, str(tmp_path / "missing.pem"), ours.ca))
