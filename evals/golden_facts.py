"""Fact tables the golden tasks are built from (evals/golden_tasks.py).

Plain, checkable facts that a small base or instruct model can mostly answer: capitals,
opposites, plurals, categories, colours, ordered sequences, arithmetic. Edit a table and
rebuild the datasets with `python -m qserve.evals.golden_tasks --write`.
"""

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("the United Kingdom", "London"), ("England", "London"), ("Canada", "Ottawa"),
    ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Cuba", "Havana"), ("Kenya", "Nairobi"),
    ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("India", "New Delhi"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Turkey", "Ankara"), ("Ukraine", "Kyiv"),
    ("the Czech Republic", "Prague"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Switzerland", "Bern"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Vietnam", "Hanoi"),
    ("the Philippines", "Manila"), ("Indonesia", "Jakarta"), ("Saudi Arabia", "Riyadh"),
    ("Israel", "Jerusalem"), ("Iceland", "Reykjavik"), ("Scotland", "Edinburgh"),
    ("Wales", "Cardiff"), ("Venezuela", "Caracas"), ("Ethiopia", "Addis Ababa"),
    ("Morocco", "Rabat"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("the United States", "Washington"), ("Brazil", "Brasilia"),
    ("Latvia", "Riga"), ("Lithuania", "Vilnius"), ("Estonia", "Tallinn"),
    ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Albania", "Tirana"),
    ("Belarus", "Minsk"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Libya", "Tripoli"),
    ("Senegal", "Dakar"), ("Uganda", "Kampala"), ("Zimbabwe", "Harare"),
    ("Ecuador", "Quito"), ("Uruguay", "Montevideo"), ("Pakistan", "Islamabad"),
    ("Afghanistan", "Kabul"), ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"),
    ("Malaysia", "Kuala Lumpur"), ("Cambodia", "Phnom Penh"), ("Syria", "Damascus"),
    ("Lebanon", "Beirut"), ("Jordan", "Amman"), ("Qatar", "Doha"), ("Cyprus", "Nicosia"),
    ("Malta", "Valletta"), ("Jamaica", "Kingston"), ("Armenia", "Yerevan"),
    ("Azerbaijan", "Baku"), ("Uzbekistan", "Tashkent"), ("Sudan", "Khartoum"),
    ("Angola", "Luanda"), ("Zambia", "Lusaka"), ("Mali", "Bamako"),
    ("Somalia", "Mogadishu"), ("Rwanda", "Kigali"), ("North Korea", "Pyongyang"),
    ("Taiwan", "Taipei"), ("Nicaragua", "Managua"), ("Montenegro", "Podgorica"),
    ("North Macedonia", "Skopje"), ("Bosnia and Herzegovina", "Sarajevo"),
    ("Laos", "Vientiane"), ("Mongolia", "Ulaanbaatar"),
]

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("left", "right"), ("day", "night"),
    ("black", "white"), ("fast", "slow"), ("happy", "sad"), ("open", "closed"),
    ("old", "young"), ("rich", "poor"), ("tall", "short"), ("heavy", "light"),
    ("early", "late"), ("full", "empty"), ("hard", "soft"), ("wet", "dry"),
    ("good", "bad"), ("first", "last"), ("in", "out"), ("on", "off"), ("true", "false"),
    ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("love", "hate"),
    ("north", "south"), ("east", "west"), ("above", "below"), ("inside", "outside"),
    ("begin", "end"), ("strong", "weak"), ("thick", "thin"), ("clean", "dirty"),
    ("loud", "quiet"), ("near", "far"), ("alive", "dead"), ("give", "take"),
    ("question", "answer"), ("friend", "enemy"), ("high", "low"), ("long", "short"),
    ("cheap", "expensive"), ("easy", "difficult"), ("wide", "narrow"), ("sweet", "sour"),
    ("front", "back"), ("summer", "winter"), ("yes", "no"), ("always", "never"),
]

PLURALS = [
    ("cat", "cats"), ("dog", "dogs"), ("box", "boxes"), ("child", "children"),
    ("mouse", "mice"), ("man", "men"), ("woman", "women"), ("foot", "feet"),
    ("tooth", "teeth"), ("city", "cities"), ("baby", "babies"), ("house", "houses"),
    ("book", "books"), ("knife", "knives"), ("leaf", "leaves"), ("bus", "buses"),
    ("apple", "apples"), ("tree", "trees"), ("car", "cars"), ("person", "people"),
    ("goose", "geese"), ("wolf", "wolves"), ("glass", "glasses"), ("dish", "dishes"),
    ("church", "churches"), ("party", "parties"), ("toy", "toys"), ("bird", "birds"),
    ("star", "stars"), ("hero", "heroes"),
]

# item, its category, three categories it does not belong to
CATEGORIES = [
    ("dog", "animal"), ("cat", "animal"), ("horse", "animal"), ("cow", "animal"),
    ("lion", "animal"), ("tiger", "animal"), ("elephant", "animal"), ("rabbit", "animal"),
    ("apple", "fruit"), ("banana", "fruit"), ("orange", "fruit"), ("pear", "fruit"),
    ("grape", "fruit"), ("cherry", "fruit"), ("peach", "fruit"), ("mango", "fruit"),
    ("car", "vehicle"), ("bus", "vehicle"), ("truck", "vehicle"), ("train", "vehicle"),
    ("bicycle", "vehicle"), ("motorcycle", "vehicle"), ("red", "color"),
    ("blue", "color"), ("green", "color"), ("yellow", "color"), ("purple", "color"),
    ("piano", "instrument"), ("guitar", "instrument"), ("violin", "instrument"),
    ("drum", "instrument"), ("trumpet", "instrument"), ("flute", "instrument"),
    ("carrot", "vegetable"), ("potato", "vegetable"), ("onion", "vegetable"),
    ("cabbage", "vegetable"), ("spinach", "vegetable"), ("shirt", "garment"),
    ("jacket", "garment"), ("sock", "garment"), ("oak", "tree"), ("pine", "tree"),
    ("maple", "tree"), ("willow", "tree"), ("iron", "metal"), ("copper", "metal"),
    ("gold", "metal"), ("silver", "metal"), ("soccer", "sport"), ("tennis", "sport"),
    ("basketball", "sport"), ("golf", "sport"),
]

COLORS = [
    ("grass", "green"), ("the sky on a clear day", "blue"), ("snow", "white"),
    ("coal", "black"), ("a ripe banana", "yellow"), ("a ripe tomato", "red"),
    ("blood", "red"), ("milk", "white"), ("a lemon", "yellow"), ("an orange", "orange"),
    ("a carrot", "orange"), ("chocolate", "brown"), ("a crow", "black"),
    ("a fresh leaf", "green"), ("the sun in a drawing", "yellow"), ("a polar bear", "white"),
    ("a strawberry", "red"), ("the ocean", "blue"), ("a lime", "green"),
    ("charcoal", "black"),
]

ANIMAL_SOUNDS = [
    ("dog", "barks"), ("cat", "meows"), ("cow", "moos"), ("lion", "roars"),
    ("duck", "quacks"), ("sheep", "bleats"), ("horse", "neighs"), ("snake", "hisses"),
    ("owl", "hoots"), ("pig", "oinks"), ("bee", "buzzes"), ("frog", "croaks"),
]

SEQUENCES = {
    "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months": ["January", "February", "March", "April", "May", "June", "July", "August",
               "September", "October", "November", "December"],
    "letters": list("abcdefghijklmnopqrstuvwxyz"),
    "number words": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                     "ten", "eleven", "twelve"],
    "ordinals": ["first", "second", "third", "fourth", "fifth", "sixth", "seventh",
                 "eighth", "ninth", "tenth"],
}

# 0..20 by value, then the tens above twenty
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                "seventeen", "eighteen", "nineteen", "twenty"]
TENS_WORDS = {30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy",
              80: "eighty", 90: "ninety"}

COPY_WORDS = [
    "apple", "river", "mountain", "window", "garden", "pencil", "yellow", "silver",
    "thunder", "blanket", "orange", "castle", "rocket", "planet", "forest", "bridge",
    "candle", "dragon", "island", "jungle", "kitten", "ladder", "marble", "needle",
    "ocean", "pepper", "rabbit", "saddle", "tiger", "umbrella", "violin", "wizard",
    "zebra", "anchor", "basket", "cactus", "desert", "engine", "feather", "glacier",
]
