"""A fixed prompt set, so runs compare like with like."""

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works, step by step.",
    "What are the main differences between Python and Rust?",
    "Describe a walk through a busy market in the morning.",
    "Give me ten tips for staying focused while studying.",
    "Write a poem about autumn leaves falling in the wind.",
    "How does a refrigerator keep food cold?",
    "Summarize the plot of a detective novel you would like to read.",
    "What should I pack for a week-long hiking trip?",
    "Explain the water cycle to a ten-year-old.",
    "Write a letter to a friend describing your new job.",
    "What are the benefits of learning a second language?",
    "Describe how bread is made, from flour to loaf.",
    "Invent a new board game and explain its rules.",
    "Why is the sky blue? Explain in simple terms.",
    "Write a dialogue between a cat and a dog about breakfast.",
]
