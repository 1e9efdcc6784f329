"""Every engine default in one place (sampling defaults live on SamplingConfig itself)."""

# models
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT_MODEL = "smollm2-135m-draft"
#: prompt lookup first, the draft model where nothing repeats (measured: greedy ×1.09 -> ×1.22 over
#: plain on the 16 built-in prompts, code ×1.31 -> ×1.40; T = 1 unchanged within noise)
DEFAULT_DRAFT = DEFAULT_DRAFT_MODEL + "+lookup"
#: the target's precision: "auto" = int8 (W8A8) where torch has fbgemm, else float32
TARGET_DTYPE = "auto"
#: the target's key/value cache: "auto" = its float dtype (float32 for int8 / q4 targets);
#: "float16" halves the cache (a long context's decoding step reads it whole), a slightly different
#: target, exact relative to itself (see ``EngineConfig.kv_dtype``)
KV_DTYPE = "auto"

# γ: a simple dynamic rule (start 6, range 3-12, ±1 on the accepted/γ ratio)
GUIDE_GAMMA_START = 6
GUIDE_GAMMA_MIN = 3
GUIDE_GAMMA_MAX = 12
GUIDE_GAMMA_UP = 0.8
GUIDE_GAMMA_DOWN = 0.4

# γ: the cost-based controller
COST_GAMMA_MAX = 12
#: the first round drafts one token: the cheapest measurement of what a drafted token costs and
#: how often the first one is accepted (a drafter that does not pay loses one short round, not a
#: long one); γ then at most doubles per round while the estimates say a longer draft pays
COST_GAMMA_START = 1
COST_GAMMA_DECAY = 0.9
COST_GAMMA_PROBE_EVERY = 8
#: γ of a probe round (backed off to plain decoding, the controller drafts this many tokens now and then)
COST_GAMMA_PROBE = 1
#: a probe after which drafting still does not pay doubles the interval, up to this many rounds
COST_GAMMA_PROBE_MAX = 128
COST_GAMMA_PRIOR_ACCEPT = 0.7
#: how many drafted positions' worth of evidence that prior counts for against the measured rates
#: (which decay by COST_GAMMA_DECAY a round, so they hold ~10 rounds).  At 2 a short run of misses
#: drove the estimate below break-even; the controller then stopped drafting and, learning nothing
#: while it did not draft, stayed stopped (a one-token probe rarely won it back): on a 2-core Zen 5
#: with the default drafter it left ~55 % of chat rounds undrafted at T = 1 while drafting a token
#: there paid ~7 % a token.  At 6 it keeps drafting through such a run; at 10 it also kept
#: drafting where the acceptance (~0.1) no longer pays (see tests/test_gamma.py)
COST_GAMMA_PRIOR_WEIGHT = 6.0
#: a verification pass counts at most this many times the running estimate of its size's cost:
#: one pass slowed down by something else on the machine (a 6.7 ms one-row pass against ~2.9 ms,
#: seen on a 2-core Zen 5) otherwise lifted the one-row estimate by a third, and since drafting
#: rounds never measure it again, kept a drafter that does not pay drafting for dozens of rounds
#: one reading below the estimate divided by this replaces it: the estimate was the disturbed one
COST_GAMMA_OUTLIER = 1.5
#: an engine's next sequence with γ auto starts backed off where the last one ended backed off and
#: its drafter would lose even at this acceptance at every position (a drafted token costing more
#: than about half a target step); it then carries the costs as they are and the acceptance
#: evidence at COST_GAMMA_CARRY of its weight (see CostGamma.successor)
COST_GAMMA_CARRY_ACCEPT = 0.5
COST_GAMMA_CARRY = 0.3

#: γ when the user asks for none in particular
DEFAULT_GAMMA = "auto"
#: bound on γ accepted from users (CLI and server)
MAX_GAMMA = 64
# token trees: most nodes one verification pass may score
MAX_TREE_NODES = 64
TREE_SHAPE = "dynamic"
TREE_WIDTH = 4
TREE_DEPTH = 6
TREE_BRANCHING = (4, 2, 2, 1, 1, 1)
TREE_NODES = 16
TREE_SAMPLE_BRANCHING = (3, 2, 1, 1, 1, 1, 1, 1)  # sampled trees (T > 0): static, siblings drawn from q
TREE_SAMPLE_WIDTH = 2
TREE_SAMPLE_EXPAND = 0.3  # sampled trees: a node below this cumulative draft probability gets no children
TREE_SIBLING_STOP = 0.8  # sampled trees: no further sibling once the drawn ones leave less than this much of q
TREE_MIN_PROB = 0.15  # deterministic trees: nodes below this cumulative draft probability are left out
TREE_EXPAND_CHILD = 0.3  # ... and a node is expanded only if a child of this probability would reach it
TREE_BUDGETS = (4, 8, 16, 32)  # node budgets the tree controller chooses from
TREE_CHAIN_WARMUP = 4  # chain rounds the tree controller measures before it probes a tree
TREE_MARGIN = 1.05  # a tree is played only while its measured rate beats the chain's by this factor
TREE_PROBE_EVERY = 8  # rounds between probes of an arm next to the best one (tree controller) ...
TREE_PROBE_MAX = 64  # ... doubling after each probe that loses, up to this many
TREE_OUTLIER = 2.5  # tree controller: a round counts at most this many times its arm's mean seconds
DEFAULT_TREE = "chain"  # chain | auto | N

# n-gram drafter (prompt lookup)
NGRAM_MAX = 3
NGRAM_MIN = 1
# hybrid drafter (DRAFT+lookup): a lookup round needs a suffix of at least HYBRID_NGRAM_MIN tokens
# seen before; its length comes from a cost controller of its own (no draft cost), START..MAX
HYBRID_NGRAM_MIN = 2
HYBRID_NGRAM_MAX = 4
HYBRID_LOOKUP_START = 4
HYBRID_LOOKUP_MAX = 12
#: a draft cache this many tokens behind the context catches up in a pass of its own, timed apart
#: (a prefill or the backlog of rounds without drafting; see ModelDrafter._after)
DRAFT_CATCH_UP_SPLIT = 16
#: prompt lookup's length controller keeps the lighter prior (the heavier one was measured for the model's drafts only)
HYBRID_LOOKUP_PRIOR_WEIGHT = 2.0
# Lookahead decoding: window of W guesses x (N - 1) rows, N-grams, pool candidates per round
LOOKAHEAD_WINDOW = 5
LOOKAHEAD_NGRAM = 3
LOOKAHEAD_CANDIDATES = 3
LOOKAHEAD_POOL = 4096  # first tokens kept in the n-gram pool (least recently refreshed dropped)
LOOKAHEAD_PER_KEY = 8  # continuations kept per first token (most recent)

# seeds: the drafter's generator is seeded with seed + DRAFT_SEED_OFFSET
DRAFT_SEED_OFFSET = 0x5EED
#: seeds run 0 .. MAX_SEED everywhere (the command line, the library, both HTTP APIs)
MAX_SEED = (1 << 63) - 1
#: the verification rules, in the order help texts list them (``specdec.verify.RULES`` checks it
#: holds exactly these): named here so that the command line's help needs no torch
VERIFICATION_METHODS: tuple[str, ...] = (
    "greedy", "token", "block", "coupled",
    "lossy_resample_p", "lossy_strict_residual", "lossy_ratio_threshold", "lossy_p_threshold",
)
#: sampling presets (``--preset``): SamplingConfig fields each sets; the options given beside it override them
SAMPLING_PRESETS: dict[str, dict[str, float]] = {
    "guide": {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.1},
    "greedy": {"temperature": 0.0},
}
#: default bound on an HTTP request body, in bytes (the server's setting may lower or raise it)
MAX_BODY_BYTES = 1 << 20

#: dynamic draft length: stop a draft after a token the drafter gives less than this probability
MIN_CONFIDENCE = 0.0
#: Kangaroo's early stopping of the draft: its own confidence threshold (the paper's η)
KANGAROO_STOP_BELOW = 0.6
#: SWIFT scores its skip set only when the scoring costs at most this share of the decoding time
#: its drafter has seen since the last one.  A scoring runs 1 + 3 passes over the last 48 tokens:
#: on a 2-core Zen 4 ~1 s for Qwen2.5-Coder-1.5B, ~30 of its target steps, and unbounded they held
#: SWIFT at ×0.74 of plain decoding over 64-token replies while the same skip set without scoring
#: ran ×1.09
SWIFT_SCORING_BUDGET = 0.05

# numerically safe sampling parameters: logits / temperature and logits * / penalty stay finite
# in float32 (|logits| of real models are < 1e3; float32 overflows past 3.4e38)
#: the smallest positive temperature (0 itself means greedy)
MIN_TEMPERATURE = 1e-3
#: the largest temperature (past it the distribution is uniform to float32 precision anyway)
MAX_TEMPERATURE = 1e4
#: the largest draft temperature factor accepted (see ``--draft-temperature-factor``)
MAX_DRAFT_TEMPERATURE_FACTOR = 100.0
#: the factors ``specdec train calibrate`` tries by default: 0.5, 0.55, ..., 1.2
CALIBRATION_FACTORS = tuple(round(0.5 + 0.05 * i, 2) for i in range(15))
#: repetition penalty bounds (1 = off)
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3
#: the largest |frequency penalty|, |presence penalty| and |logit bias| (the wire protocol's bound;
#: times a count of 8,192 over the smallest temperature still far inside float32)
MAX_PENALTY = 1e4

# batch generation (`specdec generate --prompts-file`, `Engine.generate_batch`)
#: sequences decoded together: on two cores a 16-row pass of the 4-bit SmolLM2 target gives ~3x the
#: tokens per second of one row; a job of 48 prompts ran 4-5 % faster at 32 than at 16, for twice
#: the cache memory (benchmarks/offline-batch-g)
BATCH_SEQUENCES = 16

# server
#: positions a server-side KV cache allocates first (it grows on demand up to the session's need)
SERVER_KV_INITIAL_LENGTH = 64
#: keys/values of recent prompts a server keeps for later prompts that start the same way
#: (prefix caching; SmolLM2-135M float32: 90 KiB per position, so 256 MiB hold ~2,900 positions)
SERVER_PREFIX_CACHE_BYTES = 256 << 20
#: the Responses API's stored responses kept in the server's memory (least recently used dropped
#: past either bound; the characters are those of the input and output each response added)
RESPONSES_STORED = 1024
RESPONSES_STORED_CHARS = 64 << 20
#: the edge's draft-model prefix cache in ``generate --remote --interactive`` (a SmolLM2 draft
#: position is ~4 KiB: room for ~8,000 positions of conversation)
EDGE_DRAFT_PREFIX_CACHE_BYTES = 32 << 20
#: a drafter's KV cache starts this many positions past the prompt and grows on demand: allocating
#: the model's whole context up front (32,768 positions for Qwen2.5-Coder) took 0.5-1.3 s per
#: sequence, every prompt, before the first token
DRAFT_KV_INITIAL_LENGTH = 256
#: total KV cache bytes all sessions of one server may hold (4 GiB)
SERVER_MAX_KV_BYTES = 4 << 30
#: seconds between sweeps of idle sessions
SERVER_SWEEP_INTERVAL_S = 5.0
#: the batching server's draft cap (server/draft_cap.py): look-back window, and the passes and
#: rounds (per wire mode) it needs before capping anything
DRAFT_CAP_WINDOW_S = 20.0
DRAFT_CAP_MIN_PASSES = 16
DRAFT_CAP_MIN_ROUNDS = 32
#: every this many binding caps of a wire mode give one draft position more (the cut position's estimate refreshes)
DRAFT_CAP_PROBE_EVERY = 16
#: rows per pass the server times its target at, at start-up, for the draft cap's cost curve
DRAFT_CAP_CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 96)
#: seconds a client may take to send its request headers / each part of its body
SERVER_HEADER_TIMEOUT_S = 10.0
SERVER_BODY_TIMEOUT_S = 30.0
#: seconds a stopping server (Ctrl-C, SIGTERM) gives requests in flight before it ends them with an error
SERVER_SHUTDOWN_TIMEOUT_S = 10.0
#: then how long the ended requests' handlers get to send their last event
SERVER_SHUTDOWN_FLUSH_S = 2.0
#: Retry-After (seconds) on 429 / 503 answers
SERVER_RETRY_AFTER_S = 1
#: connections (and requests in flight) one server process serves at once; more get a 503
SERVER_MAX_CONNECTIONS = 1024
#: continuous batching: rows (tokens) per forward pass of all sessions together, the longest
#: piece of one forward run in a pass (prefill chunk), and forwards waiting at most
SCHEDULER_MAX_TOKENS = 256
SCHEDULER_PREFILL_CHUNK = 128
SCHEDULER_MAX_QUEUE = 1024
#: prompt positions scored per forward pass for the prompt's log-probabilities (``echo`` with
#: ``logprobs``): the logits of a piece are [chunk, vocabulary] floats, 50 MB at 256 for SmolLM2
PROMPT_SCORE_CHUNK = 256
#: a batch-invariant native model scores a longer run of new positions (a long prompt) in passes
#: of this many rows: each row's bits are the same in any pass.  On machine M (a 2-core Zen 4) a
#: 6,000-token prompt took 13.0 s in passes of 1,024 against 16.6 s in one, 3,200 tokens 4.7
#: against 6.2 s (passes of 512 within ~5 %): the linear layers' activations stay in cache (the MLP's
#: gate and up product 7.1 against 13.2 us a row), and the causal attention's work splits evenly
#: between the threads.  Up to ~1,600 tokens pieces and one pass were level within the noise.
PROMPT_PASS_CHUNK = 1024
#: positions the native backend's rotary tables cover when a model is built; they double as a sequence needs more
ROPE_TABLE_INITIAL = 4096
#: before a pass, wait for the sequences the last pass finished to come back (their request threads
#: sample, check stops and resubmit in turn), while they keep arriving: at most this long after the
#: last arrival, never longer than the last pass took, and never while other compute work waits.
#: Without it 16 side-by-side sequences settled into passes of ~5.5 (see the server notes)
SCHEDULER_GATHER_GAP_S = 0.001
#: OpenAI requests generating at once; more are answered 429 with Retry-After
SERVER_MAX_ACTIVE_REQUESTS = 64
#: a request's choices (prompts x n) that run side by side on spare generation slots, at most; and
#: spare slots are taken only while at least half of all slots stay for requests' own (see
#: openai_api._run_choices).  On two cores batching flattens past ~16 sequences (benchmarks/offline-batch-g)
SERVER_CHOICES_SIDE_BY_SIDE = 16

# scale-out on Ray Serve
#: verifier replicas of `specdec serve --ray` and the CPUs Ray reserves for each
RAY_REPLICAS = 2
RAY_REPLICA_CPUS = 1.0
#: requests one replica takes at once (its own admission limits answer 429/503 past theirs)
RAY_MAX_ONGOING_REQUESTS = 256
#: times the gateway runs a request again on another replica when its replica died before answering
RAY_GATEWAY_RETRIES = 4

# ----------------------------------------------------------------------------- structured output
#: tokens a new grammar is walked ahead (the first token each step allows) before generation, so a
#: grammar whose matcher gives up at once (a lexer over its budget) is refused before any text
GRAMMAR_PROBE_TOKENS = 4
