"""Search env end to end: a scripted agent that follows the documents hop by hop earns reward 1."""

import json
import re

import httpx
import pytest

from envs.search.env import DATA, SearchEnv
from envs.search.generate import generate
from envs.search.scoring import exact_match, f1
from tests.envs.scripted_llm import Reply, call, say
from tests.envs.service_process import run_episode

QUESTIONS = {q["task_id"]: q for q in map(json.loads, (DATA / "questions.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.search.SearchEnv",))
    return service


def last_tool_output(messages: list[dict]) -> str:
    return messages[-1]["content"]


def open_first_hit(messages: list[dict]) -> Reply:
    return call("open", doc_id=re.search(r"\[(d\d+)\]", last_tool_output(messages)).group(1))


def search_for(pattern: str):
    """A step that searches for what `pattern` captures in the document just opened."""
    return lambda messages: call("search", query=re.search(pattern, last_tool_output(messages)).group(1))


def founder_country_agent(company: str) -> list:
    """company -> founder -> birth city -> country, reading each fact from the retrieved documents."""
    return [call("search", query=company), open_first_hit,
            search_for(r"founded in \d+ by (.+?) and has"), open_first_hit,
            search_for(r"in the city of (\w+)\."), open_first_hit,
            lambda messages: call("answer", answer=re.search(r"is a city in (\w+),", last_tool_output(messages)).group(1))]


def test_shipped_data_is_the_generators_output():
    corpus, questions = generate(seed=0)
    assert (DATA / "corpus.jsonl").read_text().splitlines() == [json.dumps(d, sort_keys=True) for d in corpus]
    assert list(QUESTIONS.values()) == questions and len(corpus) == 300 and len(questions) == 300
    assert {q["hops"] for q in questions} == {2, 3}


def test_bm25_finds_each_questions_subject_first():
    env = SearchEnv()
    titles = sorted((d["title"] for d in env.docs.values()), key=len, reverse=True)
    for q in QUESTIONS.values():
        subject = next(t for t in titles if t in q["question"])
        assert env.index.search(subject, 1)[0][0]["title"] == subject


def test_scoring():
    assert exact_match("The Zoxca.", "zoxca") == 1.0 and exact_match("Zoxca city", "Zoxca") == 0.0
    assert f1("Zoxca city", "Zoxca") == pytest.approx(2 / 3) and f1("nothing", "Zoxca") == 0.0


async def test_multi_hop_agent_right_and_wrong(service, scripted_llm):
    task_id, q = next((t, q) for t, q in QUESTIONS.items() if q["template"] == 0)
    company = re.search(r"founder of (.+) born\?", q["question"]).group(1)
    async with httpx.AsyncClient() as client:
        right_url, right = scripted_llm.script(*founder_country_agent(company))
        wrong_url, _ = scripted_llm.script(call("search", query=company), call("answer", answer=f"{q['answer']} City"))
        text_url, _ = scripted_llm.script(say(q["answer"]))
        good = await run_episode(client, service.url, task_id, right_url)
        bad = await run_episode(client, service.url, task_id, wrong_url)
        plain = await run_episode(client, service.url, task_id, text_url)
    assert (good["reward"], good["status"], good["num_turns"]) == (1.0, "completed", 7)
    assert good["info"]["prediction"] == q["answer"] and good["info"]["f1"] == 1.0
    assert bad["reward"] == 0.0 and bad["info"]["f1"] == pytest.approx(2 / 3)
    assert plain["reward"] == 1.0 and plain["info"]["used_answer_tool"] is False
    assert [t["function"]["name"] for t in right.requests[0]["tools"]] == ["search", "open", "answer"]


async def test_tool_mistakes_are_observations_not_failures(service, scripted_llm):
    task_id = next(iter(QUESTIONS))
    url, script = scripted_llm.script(call("lookup", query="x"), call("search", '{"query": '),
                                      call("open", doc="d0001"), call("open", doc_id="d9999"), say("no idea"))
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, task_id, url)
    errors = [r["messages"][-1]["content"] for r in script.requests[1:]]
    assert result["status"] == "completed" and result["reward"] == 0.0
    assert "unknown tool 'lookup'" in errors[0] and "not valid JSON" in errors[1]
    assert "missing argument(s) ['doc_id']" in errors[2] and "no document 'd9999'" in errors[3]
