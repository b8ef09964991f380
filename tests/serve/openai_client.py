"""The official `openai` Python client against a running `transformer-lab serve`.

Usage: openai_client.py BASE_URL EXPECTED_GREEDY_TEXT

The server serves model `lm` with API key `sesame`; EXPECTED is what `generate --greedy`
prints after the prompt "to be" in 40 tokens. Exits non-zero on the first failed check.
"""

import sys

import openai
from openai import OpenAI

base_url, expected = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="sesame", max_retries=0, timeout=60)


def check(what, ok, detail=""):
    if not ok:
        print(f"FAILED: {what} {detail}")
        sys.exit(1)
    print(f"ok: {what}")


models = [m.id for m in client.models.list()]
check("models.list names the model", models == ["lm"], models)

done = client.completions.create(model="lm", prompt="to be", max_tokens=40, temperature=0)
check("a completion is generate's greedy text", done.choices[0].text == expected, repr(done.choices[0].text))
check("finish_reason length", done.choices[0].finish_reason == "length", done.choices[0].finish_reason)
check("usage counts tokens", (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 40), done.usage)

scored = client.completions.create(model="lm", prompt="to be", max_tokens=0, echo=True, logprobs=2)
lp = scored.choices[0].logprobs
check("echo with logprobs scores the prompt", lp.tokens == list("to be") and lp.token_logprobs[0] is None
      and all(x < 0 for x in lp.token_logprobs[1:]) and len(lp.top_logprobs[1]) == 2, lp)
greedy = client.completions.create(model="lm", prompt="to be", max_tokens=5, temperature=0, logprobs=1)
lp = greedy.choices[0].logprobs
check("a greedy token is its position's most likely", all(
    top == {token: logprob} for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
) and lp.text_offset == [5, 6, 7, 8, 9], lp)

pieces = []
for chunk in client.completions.create(
    model="lm", prompt="to be", max_tokens=40, temperature=0, stream=True
):
    pieces.append(chunk.choices[0].text)
check("a stream comes in pieces", len(pieces) > 20, len(pieces))
check("the pieces make the same text", "".join(pieces) == expected, repr("".join(pieces)))

seeded = [
    client.completions.create(model="lm", prompt="to be", max_tokens=30, temperature=1, seed=5).choices[0].text
    for _ in range(2)
]
check("the same seed gives the same text", seeded[0] == seeded[1], seeded)

forced = client.completions.create(model="lm", prompt="to be", max_tokens=5, logit_bias={"0": 100}, seed=2)
check("a logit bias of +100 forces its token", len(set(forced.choices[0].text)) == 1, repr(forced.choices[0].text))
penalised = client.completions.create(
    model="lm", prompt="to be", max_tokens=40, temperature=0, frequency_penalty=2, presence_penalty=2,
    extra_body={"repetition_penalty": 1.5, "top_k": 5},
)
text = penalised.choices[0].text
check("the penalties discourage repeats", text != expected and len(set(text)) > len(set(expected)),
      repr((text, expected)))

several = client.completions.create(model="lm", prompt="to be", max_tokens=30, temperature=1, seed=5, n=2)
check("n choices are the request with seeds seed, seed + 1", [c.text for c in several.choices] == [
    seeded[0],
    client.completions.create(model="lm", prompt="to be", max_tokens=30, temperature=1, seed=6).choices[0].text,
] and [c.index for c in several.choices] == [0, 1], several)

chat = client.chat.completions.create(
    model="lm", messages=[{"role": "user", "content": "to be"}], max_tokens=20, temperature=0
)
check("a chat answer is the assistant's", chat.choices[0].message.role == "assistant", chat)
streamed = "".join(
    chunk.choices[0].delta.content or ""
    for chunk in client.chat.completions.create(
        model="lm",
        messages=[{"role": "user", "content": "to be"}],
        max_tokens=20,
        temperature=0,
        stream=True,
    )
    if chunk.choices
)
check("a streamed chat gives the same answer", streamed == chat.choices[0].message.content, repr(streamed))

try:
    OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    check("a wrong key is refused", False)
except openai.AuthenticationError:
    check("a wrong key is refused", True)
try:
    client.completions.create(model="nope", prompt="to", max_tokens=2)
    check("an unknown model is refused", False)
except openai.NotFoundError as e:
    check("an unknown model is refused", "nope" in str(e), e)
try:
    client.completions.create(model="lm", prompt="to €", max_tokens=2)
    check("a character outside the vocabulary is refused", False)
except openai.BadRequestError as e:
    check("a character outside the vocabulary is refused", "vocabulary" in str(e), e)

print("all checks passed")
