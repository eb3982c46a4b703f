"""Search env: multi-hop questions over a shipped corpus, BM25 retrieval, tools search / open / answer.

    AgentLoop(search, open, answer) until `answer` is called (or the model replies without a tool
    call: its text is taken as the answer) -> reward = exact match with the gold answer; F1 in info
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from envs.sdk import AgentLoop, Environment, EpisodeContext, EpisodeResult, Tool, ToolResult, schema
from envs.search.retrieval import BM25Index
from envs.search.scoring import exact_match, f1

DATA = Path(__file__).with_name("data")
SYSTEM_PROMPT = ("Answer the question using the document collection. Tools: search(query) lists matching "
                 "documents, open(doc_id) shows one in full, answer(answer) submits your final answer, which should "
                 "be as short as possible (a name, a year, a word). Questions need facts from several documents.")


class SearchEnv(Environment):
    name = "search"
    domain = "search"

    def __init__(self, data_dir: Optional[str] = None, top_k: int = 5, snippet_chars: int = 100):
        root = Path(data_dir) if data_dir else DATA
        docs = _read_jsonl(root / "corpus.jsonl")
        self.docs = {d["doc_id"]: d for d in docs}
        self.questions = {q["task_id"]: q for q in _read_jsonl(root / "questions.jsonl")}
        self.index = BM25Index(docs)
        self.top_k, self.snippet_chars = top_k, snippet_chars

    async def list_tasks(self) -> list[str]:
        return list(self.questions)

    async def run_episode(self, task_id: str, llm, sandbox, ctx: EpisodeContext) -> EpisodeResult:
        question, submitted = self.questions[task_id], []

        async def answer(answer: str) -> ToolResult:
            submitted.append(answer)
            return ToolResult("answer recorded", done=True)

        tools = [Tool("search", "Search the documents; returns doc ids, titles and snippets.",
                      schema({"query": "words to look for"}), self.search),
                 Tool("open", "Show the full text of a document.", schema({"doc_id": "a doc id from search"}),
                      self.open),
                 Tool("answer", "Submit the final answer; ends the episode.", schema({"answer": "the answer"}),
                      answer)]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question["question"]}]
        outcome = await AgentLoop(llm, ctx, tools).run(messages)
        prediction = submitted[0] if submitted else (outcome.final_text or "")
        return EpisodeResult(
            reward=exact_match(prediction, question["answer"]),
            status=outcome.status, reason=outcome.reason,
            info={"prediction": prediction, "gold": question["answer"], "f1": f1(prediction, question["answer"]),
                  "hops": question["hops"], "used_answer_tool": bool(submitted)})

    async def search(self, query: str) -> str:
        hits = self.index.search(query, self.top_k)
        if not hits:
            return "no documents match"
        return "\n".join(f"[{d['doc_id']}] {d['title']}: {d['text'][:self.snippet_chars]}" for d, _ in hits)

    async def open(self, doc_id: str) -> str:
        doc = self.docs.get(doc_id.strip().strip("[]"))
        return f"{doc['title']}\n{doc['text']}" if doc else f"error: no document {doc_id!r}"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
