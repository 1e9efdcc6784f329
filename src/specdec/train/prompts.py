"""Training prompts for target-aware drafters: generated chat instructions and standard-library code.

Nothing here comes from a dataset.  Chat instructions are built from task templates and topics
written for specdec (none of the benchmark's prompts or topics, checked in the tests); code
prompts are the header and docstring of functions of the running Python's standard library, the
same shape as the benchmark's code prompts (a function to complete), minus the benchmark's names.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

from specdec.bench.workloads import BUILTIN

_TASKS = (
    "Explain {t} to a curious teenager.",
    "Write a short paragraph about {t}.",
    "What are three common misconceptions about {t}?",
    "Give me a simple step-by-step guide to {t}.",
    "Write a friendly note inviting a neighbour to talk about {t}.",
    "List five interesting facts about {t}.",
    "Describe {t} in two sentences.",
    "What should a beginner know before starting with {t}?",
    "Write a haiku about {t}.",
    "Compare {t} with something from everyday life.",
    "Why do people care about {t}? Answer briefly.",
    "Write a short dialogue between two friends discussing {t}.",
    "Give me a checklist for {t}.",
    "Summarise the history of {t} in a few lines.",
    "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
    "Suggest a weekend project related to {t}.",
    "How would you teach {t} to a ten-year-old?",
    "Write a product description for a book about {t}.",
    "What questions should I ask an expert on {t}?",
    "Write a motivational message for someone learning about {t}.",
    "Describe a typical day of a person who works with {t}.",
    "Give three tips for getting better at {t}.",
    "Write a short story that involves {t}.",
    "What is the most important idea behind {t}?",
    "Explain {t} using an analogy.",
    "Write a tweet announcing a workshop on {t}.",
    "What mistakes do people often make with {t}?",
    "Write a short blog introduction about {t}.",
    "Give me a quiz with three questions about {t}.",
    "How has {t} changed over the last fifty years?",
    "Write an encouraging reply to a friend who is nervous about {t}.",
    # the ways people actually ask: requests, how-tos, emails, plans, opinions, rewrites
    "How do I get started with {t}?",
    "Can you help me understand {t}? Keep it short.",
    "Write a polite email to my manager about {t}.",
    "Write a short email inviting my colleagues to a talk on {t}.",
    "I have a presentation on {t} tomorrow. Give me an outline.",
    "What is the difference between a beginner and an expert in {t}?",
    "Plan a one-day workshop about {t}.",
    "Give me a list of the steps involved in {t}.",
    "Tell me a fun fact about {t}.",
    "What are the main benefits of {t}?",
    "What are the risks of {t}, and how can I avoid them?",
    "Write a limerick about {t}.",
    "Write a short speech about {t} for a school assembly.",
    "Explain {t} like I am five.",
    "Write a one-paragraph summary of {t} for a newsletter.",
    "My friend says {t} is boring. How would you convince them otherwise?",
    "Write a to-do list for a weekend spent on {t}.",
    "Draft a short social media post about {t}.",
    "What books or resources would you recommend for {t}?",
    "Give me a short lesson plan on {t}.",
    "Answer in one sentence: why does {t} matter?",
    "Write a short product review of a beginner's kit for {t}.",
    "Describe {t} from the point of view of a scientist.",
    "Write a diary entry about a day spent on {t}.",
    "What would the world be like without {t}?",
    "Create a short FAQ about {t}.",
    "Explain the basic rules or principles of {t}.",
    "Write a thank-you note to a teacher who taught me about {t}.",
    "Give me a realistic weekly schedule for learning {t}.",
    "What are some common terms used in {t}? Define each briefly.",
)

_TOPICS = (
    "gardening", "bird watching", "the water cycle", "volcanoes", "learning a new language",
    "budgeting", "public libraries", "bicycles", "chess", "composting", "the moon", "bread baking",
    "recycling", "rainforests", "electric cars", "jazz music", "the human heart", "museums",
    "hiking", "knitting", "honey bees", "solar panels", "the Roman Empire", "origami",
    "coffee", "tea ceremonies", "board games", "painting with watercolours", "running a marathon",
    "camping", "photography", "yoga", "saving money", "writing a diary", "the ocean tides",
    "earthquakes", "penguins", "dinosaurs", "trains", "airports", "volunteering", "podcasts",
    "spreadsheets", "job interviews", "public speaking", "time management", "cooking rice",
    "houseplants", "the solar system", "climate", "weather forecasts", "maps", "bridges",
    "castles", "islands", "deserts", "mountains", "rivers", "forests", "cats", "dogs",
    "horses", "the immune system", "vitamins", "drinking water", "meditation", "friendship",
    "moving to a new city", "starting a small business", "writing a resume", "video games",
    "the printing press", "electricity", "magnets", "rainbows", "clouds", "snow", "glaciers",
    "wind turbines", "the internet", "databases", "version control", "open source software",
    "spreadsheets at work", "learning to swim", "playing the guitar", "singing in a choir",
    "theatre", "films", "cartoons", "comic books", "poetry", "libraries in schools",
    "online shopping", "farmers markets", "street food", "soup", "salads", "bicycle repair",
    "car maintenance", "first aid", "fire safety", "emergency kits", "childhood games",
    "grandparents", "family traditions", "holidays", "birthdays", "weddings", "recycling paper",
    "fashion", "sewing", "pottery", "woodworking", "robots", "artificial intelligence",
    "calculators", "clocks", "the calendar", "mathematics", "prime numbers", "geometry",
    "statistics", "probability", "chemistry experiments", "microscopes", "telescopes",
    # a wider spread: science, technology, work, society, everyday life
    "black holes", "the speed of light", "gravity", "atoms", "DNA", "evolution", "vaccines",
    "antibiotics", "the nervous system", "nutrition", "protein", "muscles", "bones", "the eyes",
    "hearing", "memory", "habits", "stress", "motivation", "procrastination", "happiness",
    "negotiation", "leadership", "teamwork", "remote work", "office etiquette", "email etiquette",
    "customer service", "marketing", "advertising", "branding", "sales", "accounting", "taxes",
    "insurance", "mortgages", "renting an apartment", "buying a used car", "investing",
    "retirement savings", "credit cards", "inflation", "supply and demand", "trade", "banks",
    "cryptography", "passwords", "computer viruses", "cloud computing", "operating systems",
    "compilers", "web browsers", "search engines", "smartphones", "batteries", "semiconductors",
    "3D printing", "drones", "satellites", "GPS", "rockets", "space stations", "Mars",
    "programming in JavaScript", "learning SQL", "writing unit tests", "debugging", "code review",
    "sorting algorithms", "recursion", "hash tables", "linked lists", "binary search",
    "regular expressions", "the command line", "Linux", "containers", "APIs", "JSON", "HTTP",
    "encryption", "machine learning", "neural networks", "data visualisation", "spreadsheet formulas",
    "typing faster", "note taking", "studying for exams", "reading more books", "speed reading",
    "learning to draw", "calligraphy", "baking cakes", "making pasta", "grilling", "vegetarian cooking",
    "meal planning", "food storage", "kitchen safety", "coffee brewing", "making tea", "smoothies",
    "running shoes", "strength training", "stretching", "swimming", "cycling to work", "tennis",
    "football", "basketball", "the Olympic Games", "skiing", "surfing", "rock climbing",
    "fishing", "sailing", "kayaking", "national parks", "road trips", "train travel", "packing a suitcase",
    "learning Spanish", "learning Japanese", "sign language", "grammar", "punctuation", "idioms",
    "writing a novel", "writing a cover letter", "asking for a raise", "changing careers",
    "job hunting", "networking events", "mentoring", "parenting", "toddlers", "teenagers",
    "pets", "adopting a dog", "training a puppy", "aquariums", "bird feeders", "butterflies",
    "ants", "spiders", "sharks", "whales", "octopuses", "coral reefs", "elephants", "wolves",
    "owls", "trees", "mushrooms", "flowers", "cacti", "seeds", "soil", "irrigation", "farming",
    "organic food", "food waste", "plastic pollution", "air quality", "renewable energy",
    "nuclear power", "hydropower", "electric grids", "public transport", "city planning",
    "architecture", "skyscrapers", "tiny houses", "interior design", "home repair", "plumbing",
    "painting a room", "furniture", "cleaning the house", "laundry", "minimalism", "decluttering",
    "ancient Egypt", "the Middle Ages", "the Renaissance", "the Industrial Revolution",
    "the history of writing", "democracy", "elections", "human rights", "journalism", "newspapers",
    "radio", "television", "cinema history", "classical music", "rock music", "hip hop",
    "learning the piano", "drums", "opera", "dance", "ballet", "sculpture", "modern art",
    "photography lighting", "video editing", "animation", "storytelling", "mythology", "fairy tales",
    "science fiction", "mystery novels", "philosophy", "ethics", "logic puzzles", "riddles",
    "crossword puzzles", "magic tricks", "card games", "puzzles", "escape rooms", "theme parks",
    "zoos", "aquarium visits", "festivals", "street art", "hobbies for retirees", "gardening on a balcony",
    "saving energy at home", "smart homes", "online privacy", "social media", "screen time",
    "digital detox", "fake news", "critical thinking", "debate", "public health", "hand washing",
    "dental care", "sun protection", "hydration", "walking", "posture", "breathing exercises",
)

_BENCH_WORDS = ("tcp", "udp", "lighthouse", "photosynthesis", "pancake", "sleep", "coastal", "meeting")


def chat_prompts(n: int, *, seed: int = 0) -> list[str]:
    """``n`` distinct chat instructions (task template × topic), shuffled with ``seed``."""
    pairs = [task.format(t=topic) for task in _TASKS for topic in _TOPICS]
    bench = {p.text for p in BUILTIN}
    pairs = [p for p in pairs if p not in bench and not any(w in p.lower() for w in _BENCH_WORDS)]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def code_prompts(n: int, *, seed: int = 0, root: Path | None = None) -> list[str]:
    """``n`` completion prompts: a standard-library function's header + docstring, body removed."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    bench_names = set()  # the benchmark's ids and the functions its prompts define (code/read_csv_rows: read_rows)
    for p in BUILTIN:
        if p.category == "code":
            bench_names |= {p.id.split("/", 1)[1], *re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", p.text, re.M)}
    files = sorted(p for p in root.glob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[str] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name in bench_names or node.col_offset:
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)) or doc.end_lineno is None:
                continue
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno  # a decorator may span lines
            text = "\n".join(lines[first - 1: doc.end_lineno]) + "\n"
            if 40 <= len(text) <= 1200:
                out.append(text)
        if len(out) >= 4 * n:
            break
    rng.shuffle(out)
    return out[:n]
