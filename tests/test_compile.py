"""A whole RL step through every public op under torch.compile(fullgraph=True) with the
default (inductor) backend, in a fresh process: first use of every op (including the
csrc extension's load) happens while Dynamo traces."""
import subprocess
import sys
import textwrap

STEP = textwrap.dedent(
    """
    import torch, rlkernels
    torch.manual_seed(0)
    B, T, V, H = 2, 8, 1000, 32
    hidden = torch.randn(B * T, H, requires_grad=True)  # [N, H]
    weight = torch.randn(V, H, requires_grad=True)  # [V, H]
    labels = torch.randint(0, V, (B * T,))  # [N]
    old = torch.randn(B, T) - 3  # [B, T]
    mask = torch.rand(B, T) > 0.2  # [B, T]
    scores = torch.randn(B * 2)  # [2B]: two samples per prompt

    def step(hidden, weight, values):
        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, return_entropy=True)  # [N]
        logp2 = rlkernels.logprobs(hidden @ weight.T, labels)  # [N]
        adv_seq = rlkernels.group_advantages(scores, 2)[:B]  # [B]
        rewards = rlkernels.kl_penalty(logp.view(B, T), old).detach()  # [B, T]
        adv, ret = rlkernels.gae(rewards, values.detach(), mask, gamma=0.99, lam=0.95)  # [B, T]
        adv = rlkernels.masked_whiten(adv, mask)
        pg, metrics = rlkernels.policy_loss(logp.view(B, T), old, adv + adv_seq[:, None], mask,
                                            ref_logp=logp2.view(B, T).detach(), kl_coef=0.1,
                                            entropy=ent.view(B, T), entropy_coef=0.01)
        vf, _ = rlkernels.value_loss(values, values.detach() + 0.1, ret, mask, clip=0.2)
        return pg + vf, metrics["clipfrac"]

    values = torch.randn(B, T, requires_grad=True)
    compiled = torch.compile(step, fullgraph=True)
    loss_c, _ = compiled(hidden, weight, values)
    grads_c = torch.autograd.grad(loss_c, (hidden, weight, values))
    loss_e, _ = step(hidden, weight, values)
    grads_e = torch.autograd.grad(loss_e, (hidden, weight, values))
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    print("compiled step matches eager")
    """
)


def test_whole_step_compiles_with_inductor_in_a_fresh_process():
    result = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled step matches eager" in result.stdout
