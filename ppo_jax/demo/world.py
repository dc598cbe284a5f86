"""The synthetic world of the offline demo: a tiny language, prompts, an SFT corpus of mixed
quality, and a hidden "gold" reward that the reward model only ever sees through noisy preferences.

Prompts ask about one topic ("what do you think of the garden ?"). Responses are short word
sequences ("the garden is very lovely and warm ."). Everything is word-level: one word = one token,
so a response budget in tokens is a budget in words.

The gold reward of a response to a prompt about topic t (`gold_reward`; constants below):

  stop        a response that has not ended (EOS) within the budget of `max_response_tokens` tokens
              never stopped: it scores FLOOR = -2, whatever it says.
  relevance   +1 if it names t; -0.5 if it names another topic.
  sentiment   p positive and n negative adjectives: s(p) - 0.6 n, with
              s(p) = 1.5 (1 - 2^-p) for p <= 3 (0.75, 1.125, 1.3125: diminishing returns), then
              0.25 less for every positive adjective beyond 3 (gushing reads as insincere).
  repetition  -0.5 for every repeated occurrence of a content word (degenerate repetition);
              function words ("the", "and", ",", ...) may repeat freely.
  length      -0.5 if shorter than 4 words; -0.15 for every word beyond 10.

The best achievable gold reward is 1 + s(3) = 2.3125 (`BEST_GOLD`), e.g. "the garden is lovely ,
warm and bright .". Proof sketch: relevance <= 1, s(p) <= s(3), and every other term is a
penalty; that response pays none of them.

Why a learned proxy can be over-optimised here (so the KL leash matters): the SFT corpus rarely has
more than three positive adjectives, so the reward model sees "more praise is better" but almost
never the gushing decline; intensifiers ("very", "truly", ...) are common in the corpus's positive
answers, so a reward model learns them as evidence of quality although the gold reward ignores them
and penalises their repetition; long answers correlate with more adjectives. A policy pushed hard
against the proxy says "very very lovely , warm , bright , sunny and calm ..." - the proxy likes it,
the gold reward does not.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ppo_jax import reward_functions
from ppo_jax.data.tokenizers import build_word_tokenizer

# ----------------------------------------------------------------------------------------------
# The vocabulary (fixed lists, so token ids never depend on a seed or a hash order).

TOPICS = (
    "garden", "river", "market", "library", "museum", "forest", "harbor", "bakery", "castle",
    "village", "station", "bridge", "meadow", "island", "valley", "theater", "kitchen", "festival",
    "concert", "lake", "mountain", "beach", "orchard", "tower", "cafe", "school", "hospital",
    "stadium", "temple", "farm", "desert", "canyon", "airport", "hotel", "park", "zoo", "gallery",
    "cinema", "palace", "lighthouse", "vineyard", "workshop", "square", "chapel", "pier", "mill",
    "cottage", "garage", "studio", "ferry", "tunnel", "plaza", "quarry", "greenhouse", "pond",
    "glacier", "lagoon", "fountain", "arcade", "monastery",
)
POSITIVE = (
    "good", "great", "lovely", "bright", "warm", "calm", "pleasant", "wonderful", "cheerful", "fresh",
    "charming", "delightful", "gentle", "friendly", "peaceful", "beautiful", "excellent", "fantastic",
    "nice", "sunny", "cozy", "lively", "elegant", "splendid", "superb", "brilliant", "graceful",
    "joyful", "vibrant", "sweet", "inviting", "relaxing", "clean", "welcoming", "inspiring",
    "stunning", "magical", "tidy", "serene", "radiant",
)
NEGATIVE = (
    "bad", "awful", "dull", "cold", "noisy", "boring", "gloomy", "ugly", "dirty", "harsh", "bleak",
    "dreary", "grim", "nasty", "rough", "sad", "stale", "tense", "weak", "messy", "shabby", "sour",
    "bitter", "dim", "drab", "crowded", "smelly", "broken", "cramped", "chaotic", "dreadful",
    "terrible", "horrible", "unpleasant", "depressing", "damp", "rundown", "hostile", "tiring",
    "dusty",
)
NEUTRAL = (
    "large", "small", "old", "new", "quiet", "busy", "green", "round", "tall", "short", "long",
    "wide", "usual", "plain", "simple", "modern", "ancient", "square-shaped", "local", "famous",
    "distant", "nearby", "open", "narrow", "deep", "flat", "high", "low", "public", "private",
)
INTENSIFIERS = ("very", "really", "truly", "so", "incredibly", "extremely", "remarkably", "super")
FILLERS = (
    "well", "um", "anyway", "basically", "actually", "maybe", "perhaps", "sort", "kind", "things",
    "stuff", "know", "whatever", "like", "you", "mean", "somehow", "honestly", "probably", "guess",
    "right", "okay", "hmm", "etc",
)
# Glue words: they may repeat without penalty (they carry no content).
FUNCTION_WORDS = (
    "the", "a", "is", "was", "and", "but", ",", ".", "?", "it", "i", "of", "to", "in", "my", "this",
    "that", "with",
)
OTHER_WORDS = (
    "tell", "me", "about", "what", "do", "think", "describe", "any", "thoughts", "on", "how",
    "your", "opinion", "please", "say", "something", "can", "give", "impression", "seems", "looks",
    "feels", "find", "like", "love", "not", "at", "all", "also", "quite", "rather", "overall",
    "visit", "worth", "place", "there", "would", "again", "review", "short",
)


def vocabulary() -> list[str]:
    """Every word of the language, in id order after the special tokens (duplicates dropped)."""
    out: list[str] = []
    seen: dict[str, None] = {}
    for group in (FUNCTION_WORDS, OTHER_WORDS, TOPICS, POSITIVE, NEGATIVE, NEUTRAL, INTENSIFIERS, FILLERS):
        for word in group:
            if word not in seen:
                seen[word] = None
                out.append(word)
    return out


@functools.cache
def _tokenizer():
    return build_word_tokenizer(vocabulary())


def tokenizer():
    """The world's word-level `transformers` fast tokenizer: pad 0, bos 1, eos 2, unk 3, then the words.

    A fresh copy each call (tokenizers are mutable objects; callers may set attributes on theirs).
    """
    return copy.deepcopy(_tokenizer())


# ----------------------------------------------------------------------------------------------
# Gold reward constants (see the module docstring).

FLOOR = -2.0  # a response that never stopped
RELEVANCE = 1.0  # names the prompt's topic
WRONG_TOPIC = 0.5  # names another topic
NEGATIVE_WEIGHT = 0.6  # per negative adjective
GUSH_PENALTY = 0.25  # per positive adjective beyond GUSH_START
GUSH_START = 3
REPEAT_PENALTY = 0.5  # per repeated occurrence of a content word
SHORT_WORDS = 4  # responses shorter than this pay SHORT_PENALTY
SHORT_PENALTY = 0.5
LONG_WORDS = 10  # every word beyond this pays LONG_PENALTY
LONG_PENALTY = 0.15


def sentiment_value(num_positive: int) -> float:
    """s(p): 1.5 (1 - 2^-p) up to p = 3, then 0.25 less per extra positive adjective."""
    p = min(num_positive, GUSH_START)
    return 1.5 * (1.0 - 0.5 ** p) - GUSH_PENALTY * max(num_positive - GUSH_START, 0)


BEST_GOLD = RELEVANCE + sentiment_value(GUSH_START)  # 2.3125

_TOPIC_SET = frozenset(TOPICS)
_POSITIVE_SET = frozenset(POSITIVE)
_NEGATIVE_SET = frozenset(NEGATIVE)
_FUNCTION_SET = frozenset(FUNCTION_WORDS)


@dataclasses.dataclass(frozen=True)
class GoldBreakdown:
    """The terms of one gold reward (their sum is `total`; `total` is FLOOR when not stopped)."""

    total: float
    stopped: bool
    relevance: float
    sentiment: float
    repetition: float
    length: float
    num_positive: int
    num_negative: int
    num_words: int


def topic_of(prompt: str) -> str:
    """The topic word of a prompt (its only word from TOPICS)."""
    found = [w for w in prompt.split() if w in _TOPIC_SET]
    if len(found) != 1:
        raise ValueError(f"prompt {prompt!r} must name exactly one topic (found {found}); world prompts "
                         f"come from World.prompts")
    return found[0]


def gold_breakdown(prompt: str, response: str, stopped: bool) -> GoldBreakdown:
    """Every term of the gold reward of `response` (words separated by spaces, no EOS) to `prompt`."""
    topic = topic_of(prompt)
    words = response.split()
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    num_positive = sum(c for w, c in counts.items() if w in _POSITIVE_SET)
    num_negative = sum(c for w, c in counts.items() if w in _NEGATIVE_SET)
    relevance = (RELEVANCE if topic in counts else 0.0) - (
        WRONG_TOPIC if any(w in _TOPIC_SET and w != topic for w in counts) else 0.0)
    sentiment = sentiment_value(num_positive) - NEGATIVE_WEIGHT * num_negative
    repetition = -REPEAT_PENALTY * sum(c - 1 for w, c in counts.items() if w not in _FUNCTION_SET)
    n = len(words)
    length = -(SHORT_PENALTY if n < SHORT_WORDS else 0.0) - LONG_PENALTY * max(n - LONG_WORDS, 0)
    total = relevance + sentiment + repetition + length if stopped else FLOOR
    return GoldBreakdown(total=float(total), stopped=bool(stopped), relevance=relevance,
                         sentiment=sentiment, repetition=repetition, length=length,
                         num_positive=num_positive, num_negative=num_negative, num_words=n)


def gold_reward(prompt: str, response: str, stopped: bool) -> float:
    """The hidden gold reward of one response (see the module docstring)."""
    return gold_breakdown(prompt, response, stopped).total


# ----------------------------------------------------------------------------------------------
# Prompts and the SFT corpus.

PROMPT_TEMPLATES = (
    "tell me about the {t} .",
    "what do you think of the {t} ?",
    "describe the {t} .",
    "any thoughts on the {t} ?",
    "how was the {t} ?",
    "what is your opinion of the {t} ?",
    "please say something about the {t} .",
    "can you give me your impression of the {t} ?",
    "review the {t} .",
    "is the {t} worth a visit ?",
)

# Response moods: probability, and the adjective mix (positive, negative, neutral) they draw from.
MOODS = (
    ("positive", 0.5, (0.85, 0.0, 0.15)),
    ("mixed", 0.3, (0.45, 0.35, 0.2)),
    ("negative", 0.2, (0.0, 0.8, 0.2)),
)
# How many adjectives a response lists: 1..5, rarely more than 3 (the proxy barely sees gushing).
ADJECTIVE_COUNTS = (1, 2, 3, 4, 5)
ADJECTIVE_COUNT_PROBS = (0.3, 0.37, 0.25, 0.06, 0.02)


@dataclasses.dataclass(frozen=True)
class World:
    """The demo's world. `max_response_tokens` is the response budget (tokens, EOS included): a
    response still going after that many tokens never stopped and scores FLOOR.

    Corpus knobs (probabilities per SFT response): `p_ramble` long filler-laden answers that run past
    the budget, `p_degenerate` a word repeated several times, `p_off_topic` / `p_no_topic` another
    topic / "it" instead of the prompt's topic.
    """

    max_response_tokens: int = 16  # response budget in tokens, EOS included; past it a response scores FLOOR
    p_ramble: float = 0.1  # share of SFT responses that ramble with filler past the budget
    p_degenerate: float = 0.05  # share of SFT responses that repeat one word several times
    p_off_topic: float = 0.1  # share of SFT responses about another topic than the prompt's
    p_no_topic: float = 0.2  # share of SFT responses that say "it" instead of the prompt's topic
    eval_fraction: float = 0.2  # share of (template, topic) prompts held out for evaluation

    def __post_init__(self):
        if self.max_response_tokens < LONG_WORDS + 2:
            raise ValueError(f"World.max_response_tokens={self.max_response_tokens} is too small: the gold "
                             f"reward judges answers of up to {LONG_WORDS} words and more; use >= "
                             f"{LONG_WORDS + 2}")
        for name in ("p_ramble", "p_degenerate", "p_off_topic", "p_no_topic", "eval_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"World.{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if self.p_off_topic + self.p_no_topic > 1.0:
            raise ValueError("World.p_off_topic + World.p_no_topic must be <= 1")

    # -- vocabulary

    @property
    def tokenizer(self):
        return tokenizer()

    @property
    def vocab_size(self) -> int:
        return len(_tokenizer())

    @property
    def best_gold(self) -> float:
        return BEST_GOLD

    # -- prompts

    def all_prompts(self, split: str) -> list[str]:
        """Every prompt of a split ("train" or "eval"): a fixed, seed-independent partition of the
        (template, topic) combinations, so evaluation prompts are never trained on."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        combos = [(i, t) for i in range(len(PROMPT_TEMPLATES)) for t in range(len(TOPICS))]
        order = np.random.default_rng(12345).permutation(len(combos))
        n_eval = int(round(self.eval_fraction * len(combos)))
        chosen = sorted(order[:n_eval]) if split == "eval" else sorted(order[n_eval:])
        return [PROMPT_TEMPLATES[combos[k][0]].format(t=TOPICS[combos[k][1]]) for k in chosen]

    def prompts(self, n: int, split: str = "train", seed: int = 0) -> list[str]:
        """`n` prompts drawn (with replacement) from a split, reproducible from `seed`."""
        pool = self.all_prompts(split)
        rng = np.random.default_rng((seed, 1 if split == "train" else 2))
        return [pool[i] for i in rng.integers(0, len(pool), size=n)]

    # -- SFT corpus

    def sample_response(self, rng: np.random.Generator, prompt: str) -> str:
        """One corpus response to `prompt`: a mood, a subject, adjectives, and the odd flaw."""
        topic = topic_of(prompt)
        mood = rng.choice(len(MOODS), p=[m[1] for m in MOODS])
        mix = np.asarray(MOODS[mood][2])
        u = rng.random()
        if u < self.p_off_topic:
            others = [t for t in TOPICS if t != topic]
            subject = ["the", others[rng.integers(len(others))]]
        elif u < self.p_off_topic + self.p_no_topic:
            subject = ["it"]
        else:
            subject = ["the", topic]
        verb = ["is", "was", "seems", "looks", "feels"][rng.integers(5)]
        k = int(rng.choice(ADJECTIVE_COUNTS, p=ADJECTIVE_COUNT_PROBS))
        groups = rng.choice(3, size=k, p=mix)
        adjectives = []
        pools = {0: list(POSITIVE), 1: list(NEGATIVE), 2: list(NEUTRAL)}
        for g in groups:  # distinct adjectives within one response
            pool = pools[int(g)]
            adjectives.append(pool.pop(int(rng.integers(len(pool)))))
        # Intensifiers go with enthusiasm in this corpus, though the gold reward ignores them.
        p_intense = 0.6 if MOODS[mood][0] == "positive" else 0.2
        words: list[str] = []
        if rng.random() < 0.25:
            words += [["i", "think"], ["honestly", ","], ["overall", ","], ["well", ","]][rng.integers(4)]
        words += subject + [verb]
        for j, adj in enumerate(adjectives):
            if j > 0:
                last = j == len(adjectives) - 1
                flips = (adj in _NEGATIVE_SET) != (adjectives[j - 1] in _NEGATIVE_SET)
                words.append(("but" if flips else "and") if last else ",")
            if rng.random() < p_intense:
                words.append(INTENSIFIERS[rng.integers(len(INTENSIFIERS))])
            words.append(adj)
        words.append(".")
        if rng.random() < 0.2:
            words += [["i", "would", "visit", "again", "."], ["worth", "a", "visit", "."],
                      ["not", "at", "all", "my", "place", "."], ["i", "love", "the", topic, "."]][
                rng.integers(4)]
        if rng.random() < self.p_ramble:
            extra = int(rng.integers(self.max_response_tokens - len(words) + 1,
                                     self.max_response_tokens - len(words) + 8))
            filler = [FILLERS[i] for i in rng.integers(len(FILLERS), size=max(extra, 1))]
            cut = int(rng.integers(1, len(words)))
            words = words[:cut] + filler + words[cut:]
        if rng.random() < self.p_degenerate:
            content = [w for w in words if w not in _FUNCTION_SET]
            w = content[rng.integers(len(content))] if content else "good"
            at = words.index(w) if w in words else len(words) - 1
            words = words[:at] + [w] * int(rng.integers(2, 5)) + words[at:]
        return " ".join(words)

    def sft_corpus(self, n: int, seed: int = 0) -> list[dict[str, str]]:
        """`n` {"prompt", "response"} records from the train prompts, reproducible from `seed`."""
        rng = np.random.default_rng((seed, 3))
        prompts = self.prompts(n, "train", seed)
        return [{"prompt": p, "response": self.sample_response(rng, p)} for p in prompts]

    # -- gold reward on model outputs

    def gold(self, prompt: str, response: str, stopped: bool | None = None) -> float:
        """Gold reward; `stopped=None` infers it from the text (fewer words than the budget)."""
        if stopped is None:
            stopped = len(response.split()) < self.max_response_tokens
        return gold_reward(prompt, response, stopped)

    def gold_batch(self, prompts: Sequence[str], responses: Sequence[str],
                   stopped: Sequence[bool] | None = None) -> np.ndarray:
        """[B] float64 gold rewards."""
        stopped = [None] * len(responses) if stopped is None else list(stopped)
        return np.asarray([self.gold(p, r, s) for p, r, s in zip(prompts, responses, stopped)], np.float64)

    def decode_response(self, token_ids: Sequence[int], stop_ids: Sequence[int] = (2,)) -> tuple[str, bool]:
        """Response token ids (as sampled, stop token and padding included) -> (text, stopped).

        Words up to the first stop token; any other special token a policy emits stays in the text
        as its literal string ("<pad>"), so it counts as a (junk) word instead of vanishing.
        """
        tok = _tokenizer()
        stop = {int(s): None for s in stop_ids}
        words, stopped = [], False
        for t in token_ids:
            if int(t) in stop:
                stopped = True
                break
            words.append(tok.convert_ids_to_tokens(int(t)))
        return " ".join(words), stopped

    def best_response(self, prompt: str) -> str:
        """A response that attains BEST_GOLD."""
        topic = topic_of(prompt)
        return f"the {topic} is lovely , warm and bright ."

    # -- preferences

    def label_pairs(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
                    stopped_a: Sequence[bool], stopped_b: Sequence[bool], *,
                    rng: np.random.Generator | None, temperature: float) -> list[dict[str, Any]]:
        """Preference records {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"}.

        With `rng`, labels are Bradley-Terry noisy: a is chosen with probability
        sigmoid((gold_a - gold_b) / temperature). Without it (validation), the gold winner is chosen
        and exact ties are dropped (a tie has no right answer). `stopped_*` travel with the records
        as `chosen_stopped` / `rejected_stopped` (a response that never stopped is stored without EOS
        by tokenizing with max_response_length = max_response_tokens).
        """
        if rng is not None and not temperature > 0:
            raise ValueError(f"preference temperature must be > 0, got {temperature}")
        records = []
        for p, a, b, sa, sb in zip(prompts, responses_a, responses_b, stopped_a, stopped_b):
            ga, gb = gold_reward(p, a, sa), gold_reward(p, b, sb)
            if rng is None:
                if ga == gb:
                    continue
                a_wins = ga > gb
            else:
                a_wins = rng.random() < 1.0 / (1.0 + math.exp(-(ga - gb) / temperature))
            (c, gc, sc), (r, gr, sr) = ((a, ga, sa), (b, gb, sb)) if a_wins else ((b, gb, sb), (a, ga, sa))
            records.append({"prompt": p, "chosen": c, "rejected": r, "gold_chosen": gc,
                            "gold_rejected": gr, "chosen_stopped": bool(sc), "rejected_stopped": bool(sr)})
        return records


DEFAULT_WORLD = World()


@reward_functions.register("demo_gold")
def gold_reward_fn(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """The demo world's gold reward as a Python reward function (config: reward.functions="demo_gold"
    after `import ppo_jax.demo.world`, or "ppo_jax.demo.world:gold_reward_fn").

    It sees decoded text only, so "stopped" is inferred: a response with as many words as the default
    budget (16 tokens) never stopped. Use it with rollout.response_length = 16.
    """
    return [DEFAULT_WORLD.gold(p, r) for p, r in zip(prompts, responses)]


def world_from_config(c: Mapping[str, Any] | None) -> World:
    """A World from a config section with any of World's fields."""
    if c is None:
        return World()
    if hasattr(c, "to_dict"):  # ml_collections.ConfigDict (field references resolved)
        c = c.to_dict()
    fields = {f.name for f in dataclasses.fields(World)}
    unknown = sorted(set(c) - fields)
    if unknown:
        raise ValueError(f"world config has unknown fields {unknown}; known: {sorted(fields)}")
    return World(**dict(c))
