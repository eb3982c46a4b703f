"""The file-lookup env (the main job's task) end to end: a real service process with the namespace sandbox
and a scripted model. The answer exists only in the sandbox's files; the scripted expert's demonstrations
are exactly what the service shows the model; the tool log counts calls and failed commands."""

import httpx
import pytest

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.tokenizer import load_tokenizer
from envs.terminal import FileLookupEnv
from tests.envs.isolation import SANDBOX_ARGS, needs_namespaces
from tests.envs.scripted_llm import call, say
from tests.envs.service_process import run_episode
from trainer.sft import tokenize_dialogue

ENV = FileLookupEnv()


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.terminal.FileLookupEnv", *SANDBOX_ARGS))
    return service


def expert_script(task_id: str) -> list:
    """What the scripted expert does (FileLookupEnv.demonstrations), as replies of a scripted LLM."""
    problem = ENV.split.problem(task_id)
    return [*(call("bash", command=f"cat {name}") for name, _ in problem.files),
            say(" ".join(map(str, problem.answer)))]


def test_the_prompt_never_holds_the_answer_and_splits_are_disjoint():
    train = [ENV.split.problem(f"look-{i:05d}") for i in range(200)]
    held_out = ENV.split.eval_problems()
    assert len(held_out) == 100 and all(ENV.split.held_out(p) for p in held_out)
    assert not {p.key() for p in train} & {p.key() for p in held_out}
    for problem in train + held_out:
        assert not any(str(v) in problem.prompt for v in problem.answer)
    demos = ENV.demonstrations(200, seed=0)
    assert not {d[0]["content"] + d[-1]["content"] for d in demos} & {p.prompt + " ".join(map(str, p.answer))
                                                                     for p in held_out}


def test_demonstrations_tokenize_as_the_gateway_renders_them():
    template = GlmChatTemplate(load_tokenizer("builtin:tiny"), thinking=False)
    demo = ENV.demonstrations(1)[0]
    tokens, mask = tokenize_dialogue(template, demo, ENV.demonstration_tools())
    assert tokens[:-1] == template.render(demo, ENV.demonstration_tools())  # the last id: the final stop token
    trained = template.tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert trained.count("<tool_call>bash") == 2 and trained.count("<|observation|>") == 2
    assert "exit code" not in trained  # tool outputs are never in the loss


def test_the_lazy_expert_stops_early_and_replies_with_what_it_read():
    """lazy_expert: that share of demonstrations stops before the last file and replies with the numbers read
    so far (reward 0: the warm-up's room for RL). Every number a demonstration replies is one it read."""
    lazy = FileLookupEnv(num_files=3, names="abc", lazy_expert=0.5)
    problems = lazy.split.demonstration_problems(400, 0)
    demos = lazy.demonstrations(400, seed=0)
    assert demos == lazy.demonstrations(400, seed=0)  # seeded
    reads = [sum(m["role"] == "tool" for m in d) for d in demos]
    assert 0.4 < reads.count(3) / len(demos) < 0.6 and {1, 2} <= set(reads)
    for demo, problem, read in zip(demos, problems, reads):
        assert [int(n) for n in demo[-1]["content"].split()] == problem.answer[:read]
        assert [m["tool_calls"][0]["function"]["arguments"] for m in demo if m.get("tool_calls")] == [
            f'{{"command": "cat {name}"}}' for name, _ in problem.files[:read]]
    assert all(sum(m["role"] == "tool" for m in d) == 3 for d in FileLookupEnv(num_files=3).demonstrations(50))
    with pytest.raises(ValueError, match="lazy_expert"):
        FileLookupEnv(num_files=1, lazy_expert=0.5)


@needs_namespaces
async def test_the_expert_scores_one_and_a_guess_scores_zero(service, scripted_llm):
    task = "look-00007"
    problem = ENV.split.problem(task)
    async with httpx.AsyncClient() as client:
        expert_url, expert = scripted_llm.script(*expert_script(task))
        guess_url, _ = scripted_llm.script(say("12 34"))
        typo_url, _ = scripted_llm.script(call("bash", command="cat nosuchfile"), say("1 2"))
        good = await run_episode(client, service.url, task, expert_url)
        guess = await run_episode(client, service.url, task, guess_url)
        typo = await run_episode(client, service.url, task, typo_url)
    assert (good["reward"], good["status"], good["num_turns"]) == (1.0, "completed", 3)
    assert good["info"]["tools"] == {"calls": 2, "errors": 0, "by_tool": {"bash": 2}}
    observations = [m for m in expert.requests[-1]["messages"] if m["role"] == "tool"]
    assert [o["content"] for o in observations] == [f"exit code 0\n{v}\n" for v in problem.answer]
    assert (guess["reward"], guess["status"]) == (0.0, "completed") and "tools" not in guess["info"]
    assert typo["reward"] == 0.0 and typo["info"]["tools"] == {"calls": 1, "errors": 1, "by_tool": {"bash": 1}}
