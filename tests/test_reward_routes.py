"""Reward routes as OpenRLHF, slime, verl and vLLM's clients call them, every value against float64 transformers.

Replays are written from each framework's source and parse answers as it does (cited at each test);
OpenRLHF's own client (`SingleTurnAgentExecutor._fetch_rewards_via_http`, openrlhf 0.11.2 installed
with --no-deps) runs for real in the fresh_venv test. Token ids of the references come from the
test's own transformers tokenizer, never from the server.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import VOCAB, Reference, assert_close, build_model, post, serve_dir

# A chat template the word-level demo tokenizer tokenizes into known ids only (an unknown word is id 0, the pad id).
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'system' %}t11 {% elif m['role'] == 'user' %}"
            "t12 {% else %}t13 {% endif %}{{ m['content'] }} {{ eos_token }} {% endfor %}")
MIN_SHARED = 8


def _words(rng, n: int) -> str:
    return " ".join(f"t{x}" for x in rng.integers(3, VOCAB, n))


def _served(directory, **kw):
    server = serve_dir(directory, http_port=0, min_shared_prefix=MIN_SHARED, **kw)
    return server, f"http://127.0.0.1:{server.running.http_port}"


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """A scalar llama reward model with the demo tokenizer and a chat template; its tokenizer and reference."""
    from logitserve.demo import demo_tokenizer
    from transformers import AutoTokenizer

    directory = build_model(tmp_path_factory.mktemp("rm") / "rm", "llama", kind="reward", num_labels=1, seed=3)
    tok = demo_tokenizer(VOCAB)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    server, base = _served(directory)
    yield base, server, Reference(directory), AutoTokenizer.from_pretrained(directory)
    server.stop()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A causal llama with the demo tokenizer and no chat template."""
    from logitserve.demo import demo_tokenizer
    from transformers import AutoTokenizer

    directory = build_model(tmp_path_factory.mktemp("lm") / "lm", "llama", seed=4)
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server, base = _served(directory)
    yield base, server, Reference(directory), AutoTokenizer.from_pretrained(directory)
    server.stop()


@torch.no_grad()
def _reward(ref: Reference, ids) -> float:
    """The float64 reference's score of one sequence (its last label)."""
    return ref.model(torch.as_tensor([list(ids)])).logits[0, -1].item()


def _ids(tok, text: str, special: bool) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def _chat_ids(tok, conv: list) -> list[int]:
    """transformers' own rendering and tokenizing of a conversation."""
    return tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]


def _openrlhf_remote_rm(urls: list[str], queries, prompts, labels) -> list[dict]:
    """OpenRLHF's remote RM call (openrlhf/utils/remote_rm_utils.py `remote_rm_fn` + `request_api_wrapper`, as the
    experience maker slices a batch over every URL: batch_size = ceil(n / len(urls)), so later URLs may get empty
    lists); each answer parsed as `response.get(score_key)` with score_key "rewards", then "scores" and
    "extra_logs" as openrlhf/utils/agent.py reads them."""
    size = (len(queries) + len(urls) - 1) // len(urls)
    out = []
    for i, url in enumerate(urls):
        part = slice(i * size, (i + 1) * size)
        status, answer = post(url, "", {"query": queries[part], "prompts": prompts[part], "labels": labels[part]})
        assert status == 200, answer
        assert "rewards" in answer, answer
        out.append(answer)
    return out


@pytest.mark.live_server
def test_openrlhf_group_rewards_with_empty_shards_and_the_prompt_computed_once(rm):
    """G = 4 responses of one prompt, decoded with the special tokens kept, over 3 URLs (the last one gets empty
    lists and answers them); one BOS each; the shared prompt computed once (shared-prefix counter moves)."""
    base, server, ref, tok = rm
    rng = np.random.default_rng(1)
    prompt = tok.apply_chat_template([{"role": "user", "content": _words(rng, 12)}], tokenize=False)
    ids = [_ids(tok, prompt + _words(rng, n), False) for n in (3, 5, 4, 6)]
    queries = [tok.decode(x, skip_special_tokens=False) for x in ids]   # agent.py: decode(..., skip_special_tokens=False)
    assert all(q.startswith("<s>") for q in queries)
    shared = server.running.pipeline.shared_total
    answers = _openrlhf_remote_rm([base + "/get_reward"] * 3, queries, [prompt] * 4, ["x"] * 4)
    assert answers[-1] == {"rewards": [], "scores": [], "extra_logs": {}}
    got = [r for a in answers for r in a["rewards"]]
    assert [r for a in answers for r in a["scores"]] == got
    assert_close(got, [_reward(ref, x) for x in ids])
    assert server.running.pipeline.shared_total > shared       # the prompt's body ran once for the group
    # the same conversations as OpenAI messages, rendered server-side with the model's own template
    convs = [[{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}], [{"role": "user",
                                                                                           "content": "t9"}]]
    status, out = post(base, "/get_reward", {"messages": convs})
    assert status == 200
    assert_close(out["rewards"], [_reward(ref, _chat_ids(tok, c)) for c in convs])


async def _slime_remote_rm(url: str, sample: dict):
    """slime/rollout/rm_hub/__init__.py `remote_rm`: POST {prompt, response, label}; the JSON body is the reward."""
    status, body = post(url, "", {"prompt": sample["prompt"], "response": sample["response"], "label": sample["label"]})
    assert status == 200, body
    return body


@pytest.mark.live_server
def test_slime_remote_rm_text_and_messages_prompts(rm):
    """slime's sample with a templated text prompt (scored as prompt + response, no second BOS) and with a list of
    messages (the response appended as the assistant's turn): the bare JSON number is the reward."""
    import asyncio

    base, _, ref, tok = rm
    chat = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t30 t31 t32"}]
    prompt = tok.apply_chat_template(chat, tokenize=False)
    got = asyncio.run(_slime_remote_rm(base + "/get_reward", {"prompt": prompt, "response": "t40 t41", "label": "1"}))
    assert isinstance(got, float)
    assert_close([got], [_reward(ref, _ids(tok, prompt + "t40 t41", False))])
    got = asyncio.run(_slime_remote_rm(base + "/get_reward", {"prompt": chat, "response": "t40 t41", "label": None}))
    whole = _chat_ids(tok, chat + [{"role": "assistant", "content": "t40 t41"}])
    assert_close([got], [_reward(ref, whole)])
    got = asyncio.run(_slime_remote_rm(base + "/get_reward", {"prompt": "t7 t8", "response": " t9", "label": ""}))
    assert_close([got], [_reward(ref, _ids(tok, "t7 t8 t9", True))])     # no BOS in the text: the tokenizer adds it


def _verl_rm_prompt(tok, chat: list, response: str) -> str:
    """verl/experimental/reward_loop/reward_loop.py `_preprocess_reward_inputs`: the chat plus the response rendered
    by the reward model's template, its leading BOS text stripped."""
    rm_prompt = tok.apply_chat_template(chat + [{"role": "assistant", "content": response}], add_generation_prompt=False,
                                        tokenize=False)
    if tok.bos_token is not None and rm_prompt.startswith(tok.bos_token):
        rm_prompt = rm_prompt[len(tok.bos_token):]
    return rm_prompt


@pytest.mark.live_server
def test_verl_reward_loop_vllm_and_sglang_backends(rm):
    """verl's `compute_score_disrm`: vLLM backend POST /classify {model, input, activation: False} reading
    data[-1].probs[-1] (newer clients: use_activation and logits[-1]); SGLang backend POST /v1/embeddings
    {model, input} reading data[-1].embedding[-1]."""
    base, _, ref, tok = rm
    chat = [{"role": "user", "content": "t50 t51 t52"}]
    text = _verl_rm_prompt(tok, chat, "t60 t61")
    want = _reward(ref, _ids(tok, text, True))
    status, out = post(base, "/classify", {"model": "rm", "input": text, "activation": False})
    assert status == 200, out
    assert_close([out["data"][-1]["probs"][-1]], [want])
    status, out = post(base, "/classify", {"model": "rm", "input": text, "use_activation": False})
    entry = out["data"][-1]
    assert_close([entry["probs"][-1], entry["logits"][-1]], [want, want])
    assert_close([entry["probabilities"][-1]], [1 / (1 + np.exp(-want))])
    status, out = post(base, "/v1/embeddings", {"model": "rm", "input": text})
    assert status == 200 and out["object"] == "list" and out["data"][-1]["object"] == "embedding"
    assert_close([out["data"][-1]["embedding"][-1]], [want])


@pytest.mark.live_server
def test_classify_and_embeddings_take_messages(rm):
    """vLLM's chat-form /classify and /v1/embeddings `messages`: the model's template, its special tokens once."""
    base, _, ref, tok = rm
    conv = [{"role": "user", "content": [{"type": "text", "text": "t70 "}, {"type": "text", "text": "t71"}]},
            {"role": "assistant", "content": "t72"}]
    want = _reward(ref, _chat_ids(tok, [{"role": "user", "content": "t70 t71"}, conv[1]]))
    status, out = post(base, "/classify", {"messages": conv})
    assert status == 200, out
    assert_close(out["data"][0]["probs"], [1 / (1 + np.exp(-want))])
    assert_close(out["data"][0]["logits"], [want])
    status, out = post(base, "/v1/embeddings", {"messages": [conv, conv[:1]]})
    assert status == 200 and len(out["data"]) == 2
    assert_close([out["data"][0]["embedding"][0]], [want])


# vLLM's own example bodies, verbatim: examples/pooling/pooling/pooling_online.py (its completion form and chat form, a
# reward model served with `vllm serve ... --runner pooling`) and examples/pooling/classify's client (a list of texts).
VLLM_POOLING_TEXT = "vLLM is great!"
VLLM_CLASSIFY_PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
                         "The future of AI is"]


@pytest.fixture(scope="module")
def demo_rm(tmp_path_factory):
    """The embedded demo reward model (`logitserve serve --demo reward`'s directory, with its chat template) served
    with HTTP: its URL, float64 reference and tokenizer."""
    from logitserve.demo import export_demo
    from transformers import AutoTokenizer

    directory = export_demo(tmp_path_factory.mktemp("demo_rm") / "reward", "reward")
    server, base = _served(directory)
    yield base, Reference(directory), AutoTokenizer.from_pretrained(directory)
    server.stop()


@torch.no_grad()
def _last_token_reward(ref: Reference, ids) -> float:
    """The score head on the last position's hidden state, float64 (transformers' own pooling would skip trailing
    pad ids, and the demo's unknown word is its pad id: vLLM and this server score the last token)."""
    hidden = ref.model.model(torch.as_tensor([list(ids)])).last_hidden_state       # [1, L, H]
    return ref.model.score(hidden)[0, -1, -1].item()


@pytest.mark.live_server
def test_vllm_pooling_and_classify_examples_verbatim_on_the_demo_reward_model(demo_rm):
    """Issue 45: vLLM's /pooling chat example (content a list of text parts) was refused 400. Its bodies, and the
    classify client's, as vLLM's examples send them (the model named as /v1/models lists it), against float64
    transformers on the ids transformers' own tokenizer and chat template make."""
    import urllib.request

    base, ref, tok = demo_rm
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    sigmoid = (lambda x: 1 / (1 + np.exp(-np.asarray(x))))
    # Input like Completions API
    status, out = post(base, "/pooling", {"model": model, "input": "vLLM is great!"})
    assert status == 200, out
    assert_close(out["data"][0]["data"], sigmoid([_last_token_reward(ref, _ids(tok, VLLM_POOLING_TEXT, True))]))
    # Input like Chat API
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "vLLM is great!"}]}]}
    ids = _chat_ids(tok, [{"role": "user", "content": VLLM_POOLING_TEXT}])
    assert ids[:2] == [1, 12] and ids[-1] == 2          # the demo's template: BOS, the user's word t12, ..., EOS
    want = _last_token_reward(ref, ids)
    for route, pick in (("/pooling", lambda o: o["data"][0]["data"]), ("/classify", lambda o: o["data"][0]["probs"])):
        status, out = post(base, route, chat)
        assert status == 200, (route, out)
        assert_close(pick(out), sigmoid([want]))
        assert out["usage"]["prompt_tokens"] == len(ids)
    # the content as a string, and several conversations at once, raw scores
    status, out = post(base, "/pooling", {"messages": [[{"role": "user", "content": VLLM_POOLING_TEXT}],
                                                       [{"role": "system", "content": "t5"},
                                                        {"role": "user", "content": "t6 t7"}]],
                                          "use_activation": False})
    assert status == 200, out
    assert_close([d["data"][0] for d in out["data"]],
                 [want, _last_token_reward(ref, _chat_ids(tok, [{"role": "system", "content": "t5"},
                                                                 {"role": "user", "content": "t6 t7"}]))])
    status, out = post(base, "/classify", {"model": model, "input": VLLM_CLASSIFY_PROMPTS})
    assert status == 200, out
    assert_close([d["probs"][0] for d in out["data"]],
                 sigmoid([_last_token_reward(ref, _ids(tok, t, True)) for t in VLLM_CLASSIFY_PROMPTS]))


# A template that reads what vLLM hands over beside role and content: name, tool_call_id, tool_calls (arguments as an
# object), in words the demo tokenizer knows.
TOOL_TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}t12 {% elif m['role'] == 'tool' %}"
                 "t14 {{ m['tool_call_id'] }} {% else %}t13 {% endif %}{% if m['name'] %}t15 {{ m['name'] }} {% endif %}"
                 "{{ m['content'] }} {% for c in m['tool_calls'] or [] %}t16 {{ c['function']['name'] }} "
                 "{{ c['function']['arguments']['x'] }} {% endfor %}{{ eos_token }} {% endfor %}")


@pytest.fixture(scope="module")
def tool_rm(tmp_path_factory):
    """The scalar reward model of `rm` with TOOL_TEMPLATE: its URL, reference and tokenizer."""
    from logitserve.demo import demo_tokenizer
    from transformers import AutoTokenizer

    directory = build_model(tmp_path_factory.mktemp("tool_rm") / "rm", "llama", kind="reward", num_labels=1, seed=3)
    tok = demo_tokenizer(VOCAB)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(directory)
    server, base = _served(directory)
    yield base, Reference(directory), AutoTokenizer.from_pretrained(directory)
    server.stop()


@pytest.mark.live_server
def test_chat_messages_reach_the_template_as_vllm_hands_them_over(tool_rm):
    """Issue 43: text parts were joined with "" (vLLM: "\n"), name / tool_call_id / tool_calls dropped before the
    template, and an assistant turn with content null refused. The reference is the tokenizer's own
    apply_chat_template on the conversation as vLLM's chat_utils makes it (parts joined with "\n", null content
    "", tool-call arguments parsed from JSON), scored by float64 transformers."""
    base, ref, tok = tool_rm
    call = {"id": "t30", "type": "function", "function": {"name": "t20", "arguments": json.dumps({"x": "t8"})}}
    conv = [{"role": "user", "name": "t21", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t7"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "t30", "content": "t9"}]
    as_vllm = [{"role": "user", "name": "t21", "content": "t5\nt7"},
               {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "t20",
                                                                                          "arguments": {"x": "t8"}}}]},
               {"role": "tool", "tool_call_id": "t30", "content": "t9"}]
    ids = _chat_ids(tok, as_vllm)
    assert tok.convert_ids_to_tokens(ids).count("t16") == 1 and 0 not in ids      # every word known, the call in
    want = _reward(ref, ids)
    for route, pick in (("/classify", lambda o: o["data"][0]["logits"]), ("/get_reward", lambda o: o["rewards"]),
                        ("/v1/embeddings", lambda o: o["data"][0]["embedding"][-1:])):
        status, out = post(base, route, {"messages": [conv]} if route == "/get_reward" else {"messages": conv})
        assert status == 200, (route, out)
        assert_close(pick(out), [want])


@pytest.mark.live_server
def test_vllm_score_pairs(rm):
    """vLLM's /score: one text_1 against several text_2 (and pairwise), sigmoid of the pair's score by default."""
    base, _, ref, tok = rm
    t1, t2 = "t100 t101", ["t200", "t201 t202"]
    want = [_reward(ref, _ids(tok, t1, True) + _ids(tok, t, False)) for t in t2]
    status, out = post(base, "/score", {"model": "rm", "text_1": t1, "text_2": t2})
    assert status == 200, out
    assert [d["index"] for d in out["data"]] == [0, 1] and {d["object"] for d in out["data"]} == {"score"}
    assert_close([d["score"] for d in out["data"]], 1 / (1 + np.exp(-np.asarray(want))))
    status, out = post(base, "/v1/score", {"text_1": [t1, t1], "text_2": t2, "use_activation": False})
    assert_close([d["score"] for d in out["data"]], want)


@pytest.mark.live_server
def test_generative_scoring_label_probabilities(lm):
    """vLLM's /generative_scoring on a causal LM: the first label's probability after query + item (item + query
    with item_first), over the label tokens (apply_softmax) or the whole vocabulary; text and id inputs."""
    base, server, ref, tok = lm
    query, items, labels = "t10 t11 t12 t13 t14 t15 t16 t17 t18", ["t20 t21", "t22"], [5, 9, 5]
    q = _ids(tok, query, True)
    for first, soft in ((False, True), (True, False)):
        status, out = post(base, "/generative_scoring", {"query": query, "items": items, "label_token_ids": labels,
                                                         "item_first": first, "apply_softmax": soft})
        assert status == 200, out
        want = []
        for item in items:
            x = _ids(tok, item, False)
            lsm = torch.log_softmax(ref.logits(x + q if first else q + x)[-1], -1)
            p = torch.softmax(lsm[[5, 9]], -1)[0] if soft else lsm[5].exp()
            want.append(p.item())
        assert [d["index"] for d in out["data"]] == [0, 1]
        assert_close([d["score"] for d in out["data"]], want)
    shared = server.running.pipeline.shared_total
    status, out = post(base, "/generative_scoring", {"query": q, "items": [[20, 21], [22]], "label_token_ids": [9]})
    assert status == 200 and [d["score"] for d in out["data"]] == [1.0, 1.0]     # softmax over one label
    assert server.running.pipeline.shared_total > shared                          # the query computed once


BAD = [
    ("/get_reward", {"query": "t5", "messages": []}, 400, "query"),
    ("/get_reward", {"query": [5, 6]}, 400, "query"),
    ("/get_reward", {"query": ["t5", ""]}, 400, "query[1]"),
    ("/get_reward", {"messages": [[{"role": "robot", "content": "t5"}]]}, 400, "messages[0][0].role"),
    ("/get_reward", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/get_reward", {"messages": [[{"role": "user", "content": [{"type": "image_url"}]}]]}, 400,
     "messages[0][0].content[0]"),
    ("/get_reward", {"query": ["t5 " * 700]}, 400, "query[0]"),
    ("/get_reward", {"query": ["t5" * 600000]}, 413, "query"),
    ("/get_reward", {"prompt": 5, "response": "t5"}, 400, "prompt"),
    ("/get_reward", {"prompt": "t5", "response": None, "label": 1}, 400, "response"),
    ("/get_reward", {"prompt": "t5", "response": 7}, 400, "response"),
    ("/classify", {"messages": [{"role": "user", "content": {"text": "t5"}}]}, 400, "messages[0].content"),
    # issue 43: fields not honoured were dropped silently (an untruncated score where truncation was asked)
    ("/classify", {"input": [[1, 5, 6, 7, 8]], "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ("/pooling", {"input": "t5", "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "t5", "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "t5", "dimensions": 8}, 400, "dimensions"),
    ("/get_reward", {"query": ["t5"], "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ("/classify", {"input": "t5", "priority": 3}, 400, "priority"),
    ("/classify", {"input": "t5", "activation": "no"}, 400, "activation"),
    ("/v1/embeddings", {"input": [[5, "x"]]}, 400, "input[0][1]"),
    ("/v1/embeddings", {"input": "t5", "encoding_format": "bytes"}, 400, "encoding_format"),
    ("/v1/embeddings", {"input": [5], "model": "other"}, 404, "model"),
    ("/score", {"text_1": ["t5", "t6"], "text_2": ["t7", "t8", "t9"]}, 400, "text_2"),
    ("/score", {"text_1": "t5", "text_2": 7}, 400, "text_2"),
    ("/score", {"text_1": "t5", "text_2": "t6", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [5]}, 400, "model"),
]
BAD_LM = [
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [5], "truncate_prompt_tokens": 2}, 400,
     "truncate_prompt_tokens"),
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [VOCAB]}, 400, "label_token_ids[0]"),
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": []}, 400, "label_token_ids"),
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [-1]}, 400, "label_token_ids[0]"),
    ("/generative_scoring", {"query": "t5", "items": ["t6", [7]], "label_token_ids": [5]}, 400, "items"),
    ("/generative_scoring", {"query": "t5", "items": [], "label_token_ids": [5]}, 400, "items"),
    ("/generative_scoring", {"query": "", "items": ["t6"], "label_token_ids": [5]}, 400, "query"),
    ("/generative_scoring", {"query": [5], "items": [[6, VOCAB]], "label_token_ids": [5]}, 400, "items[0][1]"),
    ("/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [5], "apply_softmax": "yes"}, 400,
     "apply_softmax"),
    ("/classify", {"messages": [{"role": "user", "content": "t5"}]}, 400, "messages"),     # no chat template
    ("/get_reward", {"query": ["t5"]}, 400, "query"),                                       # not a reward model
    ("/v1/embeddings", {"input": "t5"}, 400, "input"),
]


@pytest.mark.live_server
def test_bad_input_gets_its_status_naming_the_field_and_both_servers_keep_serving(rm, lm):
    for (base, server, _, _), cases in ((rm, BAD), (lm, BAD_LM)):
        for path, body, code, field in cases:
            status, out = post(base, path, body)
            assert status == code, (path, body, out)
            assert out["error"]["message"].startswith(field + ":") or out["error"]["param"] == field, (path, out)
    status, out = post(rm[0], "/get_reward", {"query": ["<s> t5 t6"]})
    assert status == 200 and len(out["rewards"]) == 1
    status, out = post(lm[0], "/generative_scoring", {"query": "t5", "items": ["t6"], "label_token_ids": [5]})
    assert status == 200 and out["data"][0]["score"] == 1.0


OPENRLHF_CLIENT = r"""
import asyncio, json, sys
from openrlhf.utils.agent import SingleTurnAgentExecutor
urls, queries = json.loads(sys.argv[1]), json.loads(sys.argv[2])
executor = SingleTurnAgentExecutor(remote_rm_url=urls)
out = asyncio.run(executor._fetch_rewards_via_http(queries, ["p"] * len(queries), ["l"] * len(queries)))
print(json.dumps(out))
"""


@pytest.mark.fresh_venv
def test_openrlhf_own_client_fetches_rewards(rm, tmp_path):
    """OpenRLHF 0.11.2's SingleTurnAgentExecutor._fetch_rewards_via_http (installed with --no-deps, with aiohttp)
    against /get_reward over two URLs: every reward within 1e-5 of the float64 reference."""
    base, _, ref, tok = rm
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    "openrlhf==0.11.2", "pylatexenc", "aiohttp", "aiohappyeyeballs", "aiosignal", "attrs",
                    "frozenlist", "multidict", "propcache", "yarl", "idna"], check=True, timeout=600)
    ids = [[1, 40, 41, 42], [1, 40, 41, 43, 44], [1, 45]]
    queries = [tok.decode(x, skip_special_tokens=False) for x in ids]
    run = subprocess.run([sys.executable, "-c", OPENRLHF_CLIENT, json.dumps([base + "/get_reward"] * 2),
                          json.dumps(queries)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert_close([r for a in out for r in a["rewards"]], [_reward(ref, x) for x in ids])


@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    """A llama token classifier (a process reward model, 2 labels) served with --step-separator t7."""
    from logitserve.demo import demo_tokenizer
    from transformers import AutoTokenizer

    directory = build_model(tmp_path_factory.mktemp("prm") / "prm", "llama", kind="token", num_labels=2, seed=6)
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server, base = _served(directory, step_separator="t7")
    yield base, server, Reference(directory), AutoTokenizer.from_pretrained(directory)
    server.stop()


@torch.no_grad()
def _token_scores(ref: Reference, ids) -> np.ndarray:
    """The float64 reference's [L, num_labels] token scores of one sequence."""
    return ref.model(torch.as_tensor([list(ids)])).logits[0].numpy()


def _steps(ref: Reference, tok, ids, sep: str = "t7") -> np.ndarray:
    """The last label's float64 score at every separator, in order."""
    return _token_scores(ref, ids)[np.flatnonzero(np.asarray(ids) == tok.convert_tokens_to_ids(sep)), -1]


@pytest.mark.live_server
def test_process_reward_model_get_reward_and_classify(prm):
    """A PRM on /get_reward: OpenRLHF's batch (the last step's score as the reward, the step scores in extra_logs,
    one per query as OpenRLHF's agent reads them), the body's step_separator_ids over --step-separator, slime's
    sample; /classify (verl): the last token's scores, as for sequence classifiers."""
    base, _, ref, tok = prm
    queries = ["<s> t20 t21 t7 t22 t7 t23", "<s> t30 t7 t31 t9 t32 t9 t33 t7"]
    ids = [_ids(tok, q, False) for q in queries]
    answer = _openrlhf_remote_rm([base + "/get_reward"], queries, ["p", "p"], ["l", "l"])[0]
    want = [_steps(ref, tok, x) for x in ids]
    assert [len(s) for s in answer["extra_logs"]["step_scores"]] == [2, 2] == answer["extra_logs"]["num_steps"]
    for got, w in zip(answer["extra_logs"]["step_scores"], want):
        assert_close(got, w)
    assert_close(answer["rewards"], [w[-1] for w in want])
    assert answer["scores"] == answer["rewards"]
    status, out = post(base, "/get_reward", {"query": queries[1:], "step_separator_ids": [9]})
    assert status == 200, out
    assert_close(out["extra_logs"]["step_scores"][0], _steps(ref, tok, ids[1], "t9"))
    status, out = post(base, "/get_reward", {"prompt": "t40 t7 t41", "response": " t42 t7", "label": "1"})
    assert status == 200 and isinstance(out, float)
    assert_close([out], [_steps(ref, tok, _ids(tok, "t40 t7 t41 t42 t7", True))[-1]])
    status, out = post(base, "/classify", {"model": "prm", "input": ids, "use_activation": False})
    assert status == 200, out
    for entry, x in zip(out["data"], ids):
        assert_close(entry["logits"], _token_scores(ref, x)[-1])


@pytest.mark.live_server
def test_process_reward_model_bad_steps_name_the_field(prm):
    """A query without a separator, bad separator ids: 400 naming the field; the server keeps serving."""
    base = prm[0]
    for body, field in (({"query": ["t20 t7", "t21 t22"]}, "query[1]"),
                        ({"query": ["t20 t7"], "step_separator_ids": [VOCAB]}, "step_separator_ids[0]"),
                        ({"query": ["t20 t7"], "step_separator_ids": []}, "step_separator_ids"),
                        ({"query": ["t20 t7"], "step_separator_ids": ["t7"]}, "step_separator_ids[0]"),
                        ({"prompt": "t20", "response": " t21"}, "prompt[0]")):
        status, out = post(base, "/get_reward", body)
        assert status == 400, (body, out)
        assert out["error"]["message"].startswith(field + ":"), (body, out)
    status, out = post(base, "/get_reward", {"query": ["t20 t7"]})
    assert status == 200 and len(out["rewards"]) == 1
