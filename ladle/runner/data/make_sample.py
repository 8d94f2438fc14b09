"""Write runner/data/prompts.parquet, the sample workload (`workload=sample`): 40 English prompts
and 8 long documents.

Questions, instructions, short passages to summarise and a few longer tasks, so prompt lengths vary
from a handful of tokens to a few hundred; then 8 documents of 2,000-3,600 characters to summarise
(category "document"), sections of the Python language reference as shipped with CPython
(`pydoc_data.topics`, the text `help()` shows), so the default run has long prompts that arrive while
the short ones decode. Columns: id, category, class ("short" or "document"), prompt. Run
`python -m ladle.runner.data.make_sample` after editing.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PASSAGE_BRIDGES = (
    "The Golden Gate Bridge opened in 1937 after four years of construction. At the time it was the longest "
    "suspension bridge in the world, with a main span of 1,280 metres. Its colour, officially called "
    "International Orange, was chosen partly because it stays visible in the fog that often rolls in from the "
    "Pacific. Painting the bridge is a continuous job: a crew of painters touches up the steel every year to "
    "protect it from the salty air, which would otherwise corrode it."
)
PASSAGE_SLEEP = (
    "Sleep is not a passive state. During the night the brain cycles through several stages roughly every ninety "
    "minutes. In deep slow-wave sleep, the body repairs tissue and the brain consolidates facts learned during the "
    "day. In rapid eye movement sleep, most vivid dreaming happens and emotional memories appear to be processed. "
    "Adults who regularly sleep less than seven hours a night show poorer attention, slower reaction times and a "
    "higher risk of several chronic illnesses, even when they feel that they have adapted to the shorter schedule."
)
PASSAGE_LIBRARY = (
    "Our town library will move to the old post office building on Market Street in March. The new space is twice "
    "as large and will have a children's reading room, six study rooms that can be booked online, and a small "
    "workshop with a 3D printer and sewing machines. The library will be closed for two weeks during the move; "
    "books that are due in that period can be returned at the community centre instead, and no late fees will be "
    "charged. Volunteers who would like to help pack boxes can sign up at the front desk until the end of February."
)
PASSAGE_PHOTOSYNTHESIS = (
    "Photosynthesis is the process by which plants, algae and some bacteria turn light into chemical energy. "
    "Inside chloroplasts, the pigment chlorophyll absorbs mostly red and blue light and reflects green, which is why "
    "leaves look green. The light-dependent reactions split water molecules, releasing oxygen and producing the "
    "energy carriers ATP and NADPH. The Calvin cycle then uses those carriers to fix carbon dioxide from the air "
    "into sugars. Almost all the oxygen in the atmosphere and most of the food chains on Earth depend on this process."
)
PASSAGE_EMAIL = (
    "Hi team, quick update on the website launch. Design is finished and signed off. Development is about a week "
    "behind because the payment provider changed its API last month, so Priya is rewriting the checkout page. "
    "Testing will start on the 14th instead of the 7th. Marketing has agreed to move the announcement email by one "
    "week, but the press release is already scheduled and cannot move, so we may need a short holding page for the "
    "first few days. Please flag any other risks by Thursday. Thanks, Daniel"
)
CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total += v\n"
    "    return total / len(values)\n"
)

PROMPTS: list[tuple[str, str]] = [
    ("question", "What is the capital of Australia?"),
    ("question", "Why is the sky blue?"),
    ("question", "How many minutes are there in a week?"),
    ("question", "Who wrote the novel Pride and Prejudice, and when was it published?"),
    ("question", "What is the difference between weather and climate?"),
    ("question", "Why do cats purr?"),
    ("question", "How does a refrigerator keep food cold?"),
    ("question", "What causes the seasons on Earth? Many people think it is the distance from the Sun. Is that right?"),
    ("question", "Which is heavier, a kilogram of feathers or a kilogram of iron?"),
    ("question", "What are the main differences between a virus and a bacterium?"),
    ("question", "If a train leaves at 9:40 and the journey takes 2 hours and 35 minutes, when does it arrive?"),
    ("question", "What does a central bank do when it raises interest rates, and why?"),
    ("instruction", "Translate into French: Where is the nearest train station?"),
    ("instruction", "Write a haiku about autumn rain."),
    ("instruction", "List five tips for staying focused while studying."),
    ("instruction", "Give me three ideas for a vegetarian dinner that takes less than thirty minutes."),
    ("instruction", "Explain recursion to a ten-year-old."),
    ("instruction", "Write a short, polite email declining an invitation to a meeting on Friday."),
    ("instruction", "Suggest a name for a bakery that specialises in sourdough bread."),
    ("instruction", "Convert 72 degrees Fahrenheit to Celsius and show the steps."),
    ("instruction", "Write a limerick about a forgetful robot."),
    ("instruction", "Describe the water cycle in four sentences."),
    ("instruction", ("Write a two-paragraph story that begins with the sentence: The lighthouse keeper had never "
                    "seen a ship with black sails.")),
    ("instruction", ("Make a packing list for a three-day hiking trip in the mountains in early spring, grouped by "
                    "clothing, food, and equipment.")),
    ("instruction", ("Compare trains and planes for a 500 kilometre journey in terms of cost, time, comfort and "
                    "environmental impact. Finish with a recommendation.")),
    ("code", "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."),
    ("code", "What does this Python function do, and what happens if the list is empty?\n\n" + CODE),
    ("code", "Explain the difference between a list and a tuple in Python, with an example of when to use each."),
    ("code", ("Write a SQL query that returns the ten customers with the highest total order value from tables "
             "customers(id, name) and orders(id, customer_id, amount).")),
    ("summarize", "Summarise in one sentence:\n\n" + PASSAGE_BRIDGES),
    ("summarize", "Summarise the following passage for a busy reader:\n\n" + PASSAGE_SLEEP),
    ("summarize", "Write a two-sentence summary of this announcement:\n\n" + PASSAGE_LIBRARY),
    ("summarize", "Summarise the key points of this text as three bullet points:\n\n" + PASSAGE_PHOTOSYNTHESIS),
    ("summarize", "Summarise this email and list the action items:\n\n" + PASSAGE_EMAIL),
    ("reading", "Read the passage and answer: why was the bridge painted orange?\n\n" + PASSAGE_BRIDGES),
    ("reading", "According to the passage, what happens during deep slow-wave sleep?\n\n" + PASSAGE_SLEEP),
    ("reading", "Where can books be returned while the library is closed?\n\n" + PASSAGE_LIBRARY),
    ("reading", "What new date has been set for testing, and why did it change?\n\n" + PASSAGE_EMAIL),
    ("reasoning", "Anna is older than Ben. Ben is older than Carla. Is Carla older than Anna? Explain briefly."),
    ("reasoning", ("A shop sells pencils at 3 for 1 euro. How much do 12 pencils cost, and how many pencils can "
                  "you buy with 5 euros?")),
]


# (topic of the Python language reference, characters kept): 2,000-3,600 characters each.
DOCUMENT_TOPICS = [("assignment", 3600), ("exceptions", 2196), ("with", 3268), ("class", 2982),
                   ("try", 3400), ("import", 3000), ("function", 3500), ("execmodel", 2600)]


def documents() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out = []
    for name, chars in DOCUMENT_TOPICS:
        text = topics[name][:chars]
        text = text[: text.rfind("\n") if "\n" in text[chars // 2 :] else chars]  # end on a whole line
        out.append(("document", "Summarise this section of the Python language reference in three sentences:\n\n"
                    + text.strip()))
    return out


def write(path: Path) -> None:
    rows = PROMPTS + documents()
    table = pa.table({
        "id": [f"sample-{i:02d}" for i in range(len(PROMPTS))] + [f"doc-{i}" for i in range(len(rows) - len(PROMPTS))],
        "category": [c for c, _ in rows],
        "class": ["document" if c == "document" else "short" for c, _ in rows],  # request class: arrivals, plots
        "prompt": [p for _, p in rows],
    })
    pq.write_table(table, path)


if __name__ == "__main__":
    out = Path(__file__).with_name("prompts.parquet")
    write(out)
    print(f"wrote {out} ({len(PROMPTS)} prompts, {len(DOCUMENT_TOPICS)} documents)")
